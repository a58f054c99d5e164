"""Llama-family decoder (Llama 2/3, Mistral-style, Qwen2, Qwen3) over paged attention.

One implementation covers the family; the differences are flags read from
the HF config: QKV bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied
embeddings, explicit head_dim, RoPE scaling. Q/K/V and gate/up are fused into
single matmuls; the loader splits HF's separate weights into them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.kernels import cpu_ops
from rayvllm.kernels.metadata import AttentionMetadata
from rayvllm.layers.attention import Attention
from rayvllm.layers.layernorm import RMSNorm
from rayvllm.layers.linear import Linear
from rayvllm.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict, qkv_bias: bool, qk_norm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=bool(cfg.get("attention_bias", False)))
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.rotary = RotaryEmbedding(
            self.head_dim,
            cfg.get("max_position_embeddings", 2048),
            cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            cfg.get("rope_scaling") or cfg.get("rope_parameters"),
            dtype,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.use_c_kernels = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
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


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, qkv_bias: bool, qk_norm: bool, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, qkv_bias, qk_norm, dtype)
        self.mlp = LlamaMLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.self_attn(positions, x, metadata)
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """`forward` maps a flat token batch to hidden states; `compute_logits`
    runs the LM head only on the rows the runner selects."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: dict, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_bias = self.qkv_bias or bool(cfg.get("attention_bias", False))
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, qkv_bias, self.qk_norm, dtype) for _ in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.lm_head_t: torch.Tensor | None = None

    def optimize_for_cpu(self, use_c_kernels: bool) -> None:
        """After loading, for float32 on the CPU: transposed GEMM layouts, a
        transposed LM-head copy for small batches, and (when they built) the
        fused C kernels for norms and RoPE + KV write."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_transposed()
            elif use_c_kernels and isinstance(module, RMSNorm):
                module.use_c_kernel = True
            elif use_c_kernels and isinstance(module, LlamaAttention):
                module.use_c_kernels = True
        self.lm_head_t = self._lm_head_weight().detach().t().contiguous()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, metadata)
        x, _ = self.norm.forward_with_residual(x, residual)
        return x

    def _lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The head keeps both layouts on the CPU: the transposed one wins
        # below ~48 rows, the original above (measured with MKL, 2 threads).
        if self.lm_head_t is not None and hidden.shape[0] < 48:
            return torch.mm(hidden, self.lm_head_t).float()
        return F.linear(hidden, self._lm_head_weight()).float()

    # ---- weights -----------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume HF-named tensors; q/k/v and gate/up land in their fused slices."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, shard = _fused_target(name, self.layers[0].self_attn if self.layers else None, self.cfg)
            if target not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    param[shard[0] : shard[1]].copy_(tensor)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"weights missing from checkpoint: {sorted(missing)[:8]}")


def _fused_target(name: str, attn: LlamaAttention | None, cfg: dict) -> tuple[str, tuple[int, int] | None]:
    """HF weight name -> (our parameter name, row range inside it or None)."""
    inter = cfg["intermediate_size"]
    if attn is not None:
        q, kv = attn.q_size, attn.kv_size
        for proj, rows in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
            if f".self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), rows
    for proj, rows in (("gate_proj", (0, inter)), ("up_proj", (inter, 2 * inter))):
        if f".mlp.{proj}." in name:
            return name.replace(proj, "gate_up_proj"), rows
    return name, None


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
