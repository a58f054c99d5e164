"""OLMo 2 (Olmo2ForCausalLM) on the Llama-shaped pieces of models/llama.py.

Two differences from Llama, as transformers' modeling_olmo2.py computes them:

- Each sublayer's output is normed before it joins the residual stream, and
  no norm precedes a sublayer: `h = x + post_attention_layernorm(attn(x))`,
  `out = h + post_feedforward_layernorm(mlp(h))`; the final norm as Llama's.
- q and k are RMS-normed over the whole projection (all heads at once, a
  weight of `num_heads * head_dim`), before RoPE. Under tensor parallelism a
  rank holds only its heads, so the sum of squares of each token's row is
  all-reduced over the TP group (`ShardedRMSNorm`).

Everything else (fused QKV and gate/up, paged attention, the CPU's fused
RoPE + KV write, TP/PP sharding, weight loading) is Llama's.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext, tp_all_reduce
from rayvllm.kernels.metadata import AttentionMetadata
from rayvllm.layers.layernorm import RMSNorm
from rayvllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, Multipliers

# transformers' Olmo2Config default, where a config.json leaves it out (Llama's layers assume 1e-6).
_OLMO2_RMS_NORM_EPS = 1e-5


class ShardedRMSNorm(RMSNorm):
    """RMSNorm of a projection whose features are split across the TP group:
    this rank holds `size` of the `full_size` features (its heads, flattened)
    and the matching slice of the weight; the mean square is over all
    `full_size`. Input and output are `[T, heads, head_dim]`.

    Invariant: every rank divides the same total, in which each distinct
    feature's square counts once: a rank holding a replica of another rank's
    heads (KV heads replicated when tp_size exceeds their count) adds zero
    (`counted` False)."""

    def __init__(
        self, size: int, full_size: int, eps: float, ctx: ParallelContext, counted: bool, src_start: int
    ) -> None:
        """`src_start`: this rank's first feature in the checkpoint's weight."""
        super().__init__(size, eps)
        self.full_size = full_size
        self.parallel = ctx
        self.counted = counted
        self.src_start = src_start

    def weight_loader(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | None) -> None:
        """This rank's slice of the checkpoint's norm weight (its heads' features)."""
        dst.copy_(loaded[self.src_start : self.src_start + dst.shape[0]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        if self.parallel.tp_size == 1:  # the whole projection is here: RMSNorm's kernels apply
            return super().forward(flat).view(x.shape)
        x32 = flat.float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True) if self.counted else x32.new_zeros(x32.shape[0], 1)
        tp_all_reduce(sum_sq, self.parallel)
        x32 = x32 * torch.rsqrt(sum_sq / self.full_size + self.eps)
        return (self.weight * x32.to(x.dtype)).view(x.shape)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q/k normed over all heads (`ShardedRMSNorm`)
    in place of a per-head norm; the norms run before RoPE on every path."""

    def __init__(
        self, cfg: dict, qkv_bias: bool, dtype: torch.dtype, ctx: ParallelContext, window: int | None
    ) -> None:
        super().__init__(cfg, qkv_bias, False, dtype, ctx, window)
        total_heads = cfg["num_attention_heads"]
        total_kv = cfg.get("num_key_value_heads") or total_heads
        eps = cfg["rms_norm_eps"]
        # A replicated KV head is held by `replicas` consecutive ranks; the first of them counts its squares.
        replicas = max(ctx.tp_size // total_kv, 1)
        self.q_norm = ShardedRMSNorm(
            self.q_size, total_heads * self.head_dim, eps, ctx, True, self.q_head_start * self.head_dim
        )
        self.k_norm = ShardedRMSNorm(
            self.kv_size, total_kv * self.head_dim, eps, ctx, ctx.tp_rank % replicas == 0,
            self.kv_head_start * self.head_dim,
        )

    def _norm_rope(
        self, kernels: ModuleType, x: torch.Tensor, positions: torch.Tensor, norm: RMSNorm | None
    ) -> torch.Tensor:
        """The fused Triton kernel norms per head; this norm spans all heads,
        so it runs first and the kernel only rotates."""
        assert norm is not None
        return super()._norm_rope(kernels, norm(x), positions, None)


class Olmo2DecoderLayer(nn.Module):
    """Takes and returns Llama's pair `(x, residual)`, whose sum is the
    hidden state (x alone when residual is None): pipeline stages pass it
    on, and the model's final norm adds the two, as for Llama."""

    def __init__(
        self, cfg: dict, qkv_bias: bool, qk_norm: bool, dtype: torch.dtype, ctx: ParallelContext,
        window: int | None, multipliers: Multipliers | None,
    ) -> None:
        """`qk_norm` and `multipliers` (per-head norms, Granite's scalings) do not apply: OLMo 2 has neither."""
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.self_attn = Olmo2Attention(cfg, qkv_bias, dtype, ctx, window)
        self.mlp = LlamaMLP(hidden, cfg["intermediate_size"] // ctx.tp_size, ctx)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Out of place: the pair may be a CUDA graph's static buffers or a pipeline stage's received ones.
        hidden = x if residual is None else x + residual
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2: `Olmo2DecoderLayer`s (whose q/k norms load their rank's
    slice of the checkpoint's weight themselves)."""

    decoder_layer = Olmo2DecoderLayer

    def __init__(
        self, cfg: dict, dtype: torch.dtype, parallel: ParallelContext | None = None, with_lm_head: bool = True
    ) -> None:
        super().__init__({"rms_norm_eps": _OLMO2_RMS_NORM_EPS, **cfg}, dtype, parallel, with_lm_head)
