"""Llama-family decoder (Llama 2/3, Mistral-style, Qwen2, Qwen3) over paged attention.

One implementation covers the family; the differences are flags read from
the HF config: QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied
embeddings, explicit head_dim, RoPE scaling. Q/K/V and gate/up are fused into
single matmuls; the loader splits HF's separate weights into them.

Parallelism (Megatron-style): QKV and gate/up are column-parallel (each TP
rank holds its heads / its slice of the intermediate size), O and down are
row-parallel with an all-reduce; KV heads split across ranks, replicated when
TP exceeds their count; embedding and LM head are vocabulary-parallel. A
pipeline stage holds a contiguous run of layers; the first embeds, the last
norms and computes logits, the others take and return (hidden, residual).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.kernels import cpu_ops, gemm_select
from rayvllm.kernels.metadata import AttentionMetadata
from rayvllm.layers.attention import Attention
from rayvllm.layers.layernorm import RMSNorm
from rayvllm.layers.linear import Linear, RowParallelLinear, RowSlice
from rayvllm.layers.rotary import RotaryEmbedding
from rayvllm.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.models.honoured import Honours, check_honoured, layer_rope, layer_windows


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers `[start, end)` of a pipeline stage: contiguous, sizes differing
    by at most one, earlier stages taking the extra layers."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def check_parallel_sizes(cfg: dict, tp_size: int, pp_size: int) -> None:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % tp_size:
        raise InvalidParameterError(
            "tensor_parallel_size", f"{tp_size} does not divide the {heads} attention heads"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise InvalidParameterError(
            "tensor_parallel_size",
            f"{tp_size} and the {kv_heads} KV heads must divide one another",
        )
    if cfg["intermediate_size"] % tp_size:
        raise InvalidParameterError(
            "tensor_parallel_size", f"{tp_size} does not divide intermediate_size {cfg['intermediate_size']}"
        )
    if pp_size > cfg["num_hidden_layers"]:
        raise InvalidParameterError(
            "pipeline_parallel_size", f"{pp_size} stages for {cfg['num_hidden_layers']} layers"
        )


class LlamaAttention(nn.Module):
    """Holds this TP rank's heads: query heads `[q_head_start, +num_heads)`
    and KV heads `[kv_head_start, +num_kv_heads)` of the checkpoint's."""

    def __init__(
        self, cfg: dict, qkv_bias: bool, qk_norm: bool, dtype: torch.dtype, ctx: ParallelContext,
        window: int | None = None, scale: float | None = None,
    ) -> None:
        """`scale`: the softmax scale (None: 1 / sqrt(head_dim))."""
        super().__init__()
        hidden = cfg["hidden_size"]
        total_heads = cfg["num_attention_heads"]
        total_kv = cfg.get("num_key_value_heads") or total_heads
        self.head_dim = cfg.get("head_dim") or hidden // total_heads
        self.num_heads = total_heads // ctx.tp_size
        self.q_head_start = ctx.tp_rank * self.num_heads
        if total_kv >= ctx.tp_size:
            self.num_kv_heads = total_kv // ctx.tp_size
            self.kv_head_start = ctx.tp_rank * self.num_kv_heads
        else:  # replicated: each KV head serves tp_size / total_kv ranks
            self.num_kv_heads = 1
            self.kv_head_start = ctx.tp_rank // (ctx.tp_size // total_kv)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_src, kv_src = self.q_head_start * self.head_dim, self.kv_head_start * self.head_dim
        q_rows, kv_rows = total_heads * self.head_dim, total_kv * self.head_dim
        q, kv = self.q_size, self.kv_size
        self.qkv_proj = Linear(hidden, q + 2 * kv, bias=qkv_bias, shards={
            "q": RowSlice(0, q_src, q), "k": RowSlice(q, kv_src, kv, fused=q_rows),
            "v": RowSlice(q + kv, kv_src, kv, fused=q_rows + kv_rows),
        })
        self.o_proj = RowParallelLinear(
            q, hidden, bool(cfg.get("attention_bias", False)), ctx, (q_src, q_src + q) if ctx.tp_size > 1 else None
        )
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        theta, rope = layer_rope(cfg, window)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.get("max_position_embeddings", 2048), theta, rope, dtype)
        scale = self.head_dim**-0.5 if scale is None else scale
        # Only a family whose Honours has softcapping gets this far with a cap set.
        softcap = cfg.get("attn_logit_softcapping")
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, window, softcap)
        self.use_c_kernels = False
        self.use_triton_kernels = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.use_triton_kernels:
            from rayvllm.kernels import triton_fused

            q = self._norm_rope(triton_fused, q, positions, self.q_norm)
            k = self._norm_rope(triton_fused, k, positions, self.k_norm)
            return self.o_proj(self.attn(q, k, v, metadata).view(-1, self.q_size))
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.use_c_kernels:
            q, k = cpu_ops.rope_and_cache(
                q, k, v, positions, self.rotary.cos, self.rotary.sin, metadata.slot_mapping,
                self.attn.key_cache, self.attn.value_cache,
            )
            o = self.attn(q, k, v, metadata, kv_written=True)
        else:
            q, k = self.rotary(positions, q, k)
            o = self.attn(q, k, v, metadata)
        return self.o_proj(o.view(-1, self.q_size))

    def _norm_rope(
        self, kernels: ModuleType, x: torch.Tensor, positions: torch.Tensor, norm: RMSNorm | None
    ) -> torch.Tensor:
        """One fused kernel: the head norm (when the model has one) and RoPE."""
        weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        return kernels.norm_rope(x, positions, self.rotary.cos, self.rotary.sin, weight, eps)


class LlamaMLP(nn.Module):
    """`intermediate` is this TP rank's slice of the intermediate size;
    `activation` gates the up projection: SiLU (Llama's; fused kernels on
    CPU and GPU) or transformers' gelu_pytorch_tanh (Gemma's GeGLU)."""

    def __init__(self, hidden: int, intermediate: int, ctx: ParallelContext, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        self.intermediate = intermediate
        src = ctx.tp_rank * intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, shards={
            "gate": RowSlice(0, src, intermediate), "up": RowSlice(intermediate, src, intermediate,
                                                                   fused=intermediate * ctx.tp_size),
        })
        self.down_proj = RowParallelLinear(
            intermediate, hidden, False, ctx, (src, src + intermediate) if ctx.tp_size > 1 else None
        )
        self.use_c_kernel = False
        self.use_triton_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_triton_kernel:
            from rayvllm.kernels import triton_fused

            return self.down_proj(triton_fused.silu_and_mul(gate_up))
        if self.use_c_kernel:
            return self.down_proj(cpu_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        if self.activation == "gelu_pytorch_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: dict, qkv_bias: bool, qk_norm: bool, dtype: torch.dtype, ctx: ParallelContext,
        window: int | None = None, multipliers: "Multipliers | None" = None,
    ) -> None:
        """`window`: this layer's sliding window (None: full attention);
        `multipliers`: Granite's scalings (None: Llama's, all 1)."""
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        scale = multipliers.attention if multipliers is not None else None
        self.self_attn = LlamaAttention(cfg, qkv_bias, qk_norm, dtype, ctx, window, scale)
        # Each sublayer's output is scaled before it joins the residual stream.
        self.residual_multiplier = multipliers.residual if multipliers is not None else 1.0
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"] // ctx.tp_size, ctx)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.self_attn(positions, x, metadata)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        x = self.mlp(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x, residual


class LlamaForCausalLM(nn.Module):
    """`forward` maps a flat token batch to hidden states (on a non-last
    pipeline stage: to `(hidden, residual)` for the next stage);
    `compute_logits` runs the LM head only on the rows the runner selects.

    Layer modules are indexed locally (`layers[0]` is global layer
    `start_layer`); checkpoint names are global and mapped on load.
    """

    qkv_bias = False
    qk_norm = False
    # What the family's layers do beyond Llama's (models/honoured.py).
    honours = Honours()
    # (our parameter, the checkpoint's projection, its shard id): projections
    # a checkpoint stores apart and the layers stack into one matmul; a
    # checkpoint that stores the stacked tensor itself (Phi-3) loads it whole.
    stacked_params: tuple[tuple[str, str, str], ...] = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", "gate"), ("gate_up_proj", "up_proj", "up"),
    )
    # Built as (cfg, qkv_bias, qk_norm, dtype, ctx, window, multipliers);
    # `forward(positions, x, residual, metadata)` -> (x, residual), where
    # the hidden state is x + residual (x alone before the first layer); it
    # holds `self_attn` (a `LlamaAttention`) and `mlp` (a `LlamaMLP`).
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    def __init__(
        self, cfg: dict, dtype: torch.dtype, parallel: ParallelContext | None = None, with_lm_head: bool = True
    ) -> None:
        """`with_lm_head=False`: a pooling model's, whose last stage stops at the final norm."""
        super().__init__()
        ctx = parallel or ParallelContext()
        check_honoured(cfg, self.honours)
        check_parallel_sizes(cfg, ctx.tp_size, ctx.pp_size)
        self.cfg = cfg
        self.parallel = ctx
        self.start_layer, self.end_layer = stage_layers(cfg["num_hidden_layers"], ctx.pp_rank, ctx.pp_size)
        qkv_bias = self.qkv_bias or bool(cfg.get("attention_bias", False))
        vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden, ctx) if ctx.is_first_stage else None
        windows = layer_windows(cfg)
        self.multipliers = self.multipliers_of(cfg)
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, qkv_bias, self.qk_norm, dtype, ctx, windows[i], self.multipliers)
            for i in range(self.start_layer, self.end_layer)
        )
        # Only a family whose Honours has softcapping gets this far with a cap set.
        self.final_logit_softcapping: float | None = cfg.get("final_logit_softcapping")
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.norm: RMSNorm | None = None
        self.lm_head: ParallelLMHead | None = None
        if ctx.is_last_stage:
            self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))
        if ctx.is_last_stage and with_lm_head:
            self.lm_head = ParallelLMHead(vocab, hidden, ctx)
            if self.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight

    def optimize_for_cpu(self, use_c_kernels: bool, fused_kv_write: bool = True, batch_invariant: bool = False) -> None:
        """After loading, for float32 on the CPU: each weight shape's GEMM
        plan (timed on this CPU, or cached; kernels/gemm_select.py; the C
        kernel alone when `batch_invariant`), and (when they built) the fused
        C kernels for norms and, if the attention backend allows it
        (`fused_kv_write`), RoPE + KV write."""
        gemms = [m for m in self.modules() if isinstance(m, (Linear, ParallelLMHead))]
        gemm_select.plan_modules(gemms, use_c_kernels, batch_invariant)
        for module in self.modules():
            if use_c_kernels and isinstance(module, RMSNorm):
                module.use_c_kernel = True
            elif use_c_kernels and isinstance(module, LlamaMLP):
                module.use_c_kernel = module.activation == "silu" and cpu_ops.silu_and_mul_ahead()
            elif use_c_kernels and fused_kv_write and isinstance(module, LlamaAttention):
                module.use_c_kernels = True

    def optimize_for_gpu(self) -> None:
        """After loading, for half precision on CUDA: the fused Triton
        kernels (kernels/triton_fused.py) for norms, q/k norm + RoPE and
        SiLU-and-mul. Float32, the parity mode, keeps torch's ops."""
        for module in self.modules():
            if isinstance(module, RMSNorm) or (isinstance(module, LlamaMLP) and module.activation == "silu"):
                module.use_triton_kernel = True
            elif isinstance(module, LlamaAttention):
                module.use_triton_kernels = True

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` on the first stage, `intermediate` (hidden, residual) on the others."""
        if self.embed_tokens is not None:
            x, residual = self.embed_tokens(input_ids), None
            if self.multipliers is not None and self.multipliers.embedding != 1.0:
                x = x * self.multipliers.embedding
        else:
            assert intermediate is not None
            x, residual = intermediate
        for layer in self.layers:
            x, residual = layer(positions, x, residual, metadata)
        if self.norm is None:
            assert residual is not None
            return x, residual
        x, _ = self.norm.forward_with_residual(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary float32 logits on the driver rank; None elsewhere.
        Every TP rank of the last stage must call it (it gathers)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits = self.lm_head(hidden)
        if logits is not None and self.multipliers is not None and self.multipliers.logits_scaling != 1.0:
            logits = logits / self.multipliers.logits_scaling
        if logits is not None and self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    @classmethod
    def multipliers_of(cls, cfg: dict) -> "Multipliers | None":
        """The family's scalings (None: Llama's, all 1)."""
        return None

    # ---- weights -----------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume HF-named tensors: keep this stage's layers, this TP rank's
        slices, and land q/k/v and gate/up in their fused parameters."""
        params = dict(self.named_parameters())
        missing = set(params) - self._load_into(params, weights)
        if missing:
            raise KeyError(f"weights missing from checkpoint: {sorted(missing)[:8]}")

    def _load_into(self, params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`load_weights` into `params` (our name -> its tensor); returns the names loaded."""
        loaded: set[str] = set()
        for name, tensor in self.remapped(weights):
            local = self._local_name(name)
            if local is None:
                continue
            if local == "embed_tokens.weight" or local == "lm_head.weight":
                self._load_vocab(local, tensor, loaded)
                continue
            target, shard = self.param_of(local)
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            # The module owning the parameter slices its rank's share (layers/linear.py); others hold it whole.
            loader = getattr(self.get_submodule(target.rpartition(".")[0]), "weight_loader", None)
            with torch.no_grad():
                if loader is None:
                    params[target].copy_(tensor)
                else:
                    loader(params[target], tensor, shard)
            loaded.add(target)
        return loaded

    def param_of(self, name: str) -> tuple[str, str | None]:
        """A checkpoint tensor's name (layer index local) -> the parameter it
        loads into and the shard of it that it fills (None: all of it, or
        every shard of a fused tensor)."""
        for param, checkpoint, shard in self.stacked_params:
            if f".{checkpoint}." in name:
                return name.replace(f".{checkpoint}.", f".{param}."), shard
        return name, None

    def remapped(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the family's layers take them (Gemma's
        norms scale by 1 + weight: it adds the 1)."""
        return weights

    def _local_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this stage's parameters name it
        (layer index local), or None for one this stage does not hold."""
        if "rotary_emb.inv_freq" in name:
            return None
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            index = int(name.split(".", 2)[1])
            if not self.start_layer <= index < self.end_layer:
                return None
            return f"layers.{index - self.start_layer}." + name.split(".", 2)[2]
        if name.startswith("norm.") and self.norm is None:
            return None
        return name

    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`load_weights` into the live model: every parameter keeps its
        storage (captured CUDA graphs stay valid) and each CPU GEMM plan's
        layouts are refilled where they are (kernels/gemm_select.py), so an
        update costs about a copy of the weights per layout rather than a
        new model. `weights` must be whole and checked
        (worker/weight_transfer.py does): a tensor missing here would leave
        the model half updated."""
        planned = {name: m for name, m in self.named_modules() if isinstance(m, Linear) and m.gemm is not None}
        by_module: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in planned}
        rest: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            local = self._local_name(name)
            module = None if local is None else self.param_of(local)[0].rpartition(".")[0]
            (by_module[module] if module in by_module else rest).append((name, tensor))
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        loaded = self._load_into(params, rest)
        # A planned module's weight is assembled (q, k and v side by side,
        # say) in one scratch buffer that every module reuses in turn: it is
        # paged in once, and still in cache when its layouts are filled.
        arena = torch.empty(max((m.gemm.out_features * m.gemm.in_features for m in planned.values()), default=0))
        for name, module in planned.items():
            staging = params[f"{name}.weight"] = module.gemm.staging(arena)
            loaded |= self._load_into(params, by_module[name])
            module.gemm.load(staging)
        if self.lm_head is not None and self.lm_head.gemm is not None:
            self.lm_head.gemm.load(self.lm_head.weight)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"weights missing from the update: {sorted(missing)[:8]}")

    def _load_vocab(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> None:
        """The embedding feeds the first stage, and the LM head too when tied;
        `lm_head.weight` of a tied checkpoint is ignored."""
        if name == "embed_tokens.weight" and self.embed_tokens is not None:
            self.embed_tokens.load_full(tensor)
            loaded.add("embed_tokens.weight")
        if self.lm_head is None or (name == "lm_head.weight") == self.tie_word_embeddings:
            return
        if self.lm_head.weight is not getattr(self.embed_tokens, "weight", None):
            self.lm_head.load_full(tensor)
            loaded.add("lm_head.weight")


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class GraniteForCausalLM(LlamaForCausalLM):
    @classmethod
    def multipliers_of(cls, cfg: dict) -> "Multipliers":
        return Multipliers.of(cfg)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: Llama's layers; its checkpoint's fused q/k/v and gate/up
    tensors load whole (each rank's `Linear` takes its rows of every shard)."""


@dataclass(frozen=True)
class Multipliers:
    """Granite's scalings: embeddings times `embedding`, the softmax scale
    `attention` (instead of 1 / sqrt(head_dim)), each sublayer's output
    times `residual` before it joins the residual stream, and the logits
    divided by `logits_scaling`."""

    embedding: float
    attention: float
    residual: float
    logits_scaling: float

    @staticmethod
    def of(cfg: dict) -> "Multipliers":
        return Multipliers(
            float(cfg.get("embedding_multiplier", 1.0)), float(cfg.get("attention_multiplier", 1.0)),
            float(cfg.get("residual_multiplier", 1.0)), float(cfg.get("logits_scaling", 1.0)),
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
