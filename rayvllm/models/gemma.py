"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP, arranged
as Gemma arranges them.

Differences from Llama, each read from the HF config: a norm before and
after each sublayer (`input_layernorm`, `post_attention_layernorm`,
`pre_feedforward_layernorm`, `post_feedforward_layernorm`), all scaling by
1 + weight (the loader stores 1 + weight, so the layers' RMSNorm and its
kernels apply unchanged); embeddings times sqrt(hidden_size); a softmax
scale of `query_pre_attn_scalar ** -0.5`; a GeGLU MLP (tanh GELU);
sliding-window layers alternating with full ones (`layer_types`). Gemma 2
soft-caps the attention and final logits; Gemma 3 norms q and k per head
and gives its sliding layers their own RoPE base.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.kernels.metadata import AttentionMetadata
from rayvllm.layers.layernorm import RMSNorm
from rayvllm.models.honoured import Honours
from rayvllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, Multipliers

GEMMA_ACTIVATION = "gelu_pytorch_tanh"


class GemmaDecoderLayer(nn.Module):
    """Each sublayer's output is normed before it joins the residual stream
    (on top of Llama's norm before it). Hidden state in, as everywhere:
    x + residual."""

    def __init__(
        self, cfg: dict, qkv_bias: bool, qk_norm: bool, dtype: torch.dtype, ctx: ParallelContext,
        window: int | None, multipliers: Multipliers | None,
    ) -> None:
        super().__init__()
        assert multipliers is not None, "a Gemma layer takes its softmax scale from the model's Multipliers"
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(cfg, qkv_bias, qk_norm, dtype, ctx, window, multipliers.attention)
        self.mlp = LlamaMLP(hidden, cfg["intermediate_size"] // ctx.tp_size, ctx, GEMMA_ACTIVATION)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, metadata))
        x, residual = self.pre_feedforward_layernorm.forward_with_residual(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    honours = Honours(activation=GEMMA_ACTIVATION, softcapping=True, query_pre_attn_scalar=True)
    decoder_layer = GemmaDecoderLayer

    @classmethod
    def multipliers_of(cls, cfg: dict) -> Multipliers:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return Multipliers(
            embedding=cfg["hidden_size"] ** 0.5,
            attention=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            residual=1.0,
            logits_scaling=1.0,
        )

    def remapped(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Every norm's checkpoint weight w scales by 1 + w: stored so, in
        float32 first (which is how transformers adds it)."""
        for name, tensor in super().remapped(weights):
            if name.endswith("norm.weight"):
                tensor = (tensor.float() + 1.0).to(tensor.dtype)
            yield name, tensor


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
