"""Rotary position embedding (neox / rotate-half layout, as HF Llama/Qwen)."""

from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "longrope":
        # Within its original context (the engine serves no further:
        # config.rope_length_limit) LongRoPE divides each frequency by its short factor.
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


def attention_scaling(scaling: dict | None) -> float:
    """The factor LongRoPE multiplies cos and sin by (1 for the other
    kinds): its `attention_factor`, else sqrt(1 + ln(factor) / ln(original
    context)), `factor` defaulting to the ratio of the context lengths."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or scaling["max_position_embeddings"] / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1's frequency-dependent scaling: long wavelengths are divided by
    # `factor`, short ones kept, and the band between interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position up to `max_position`."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        scale = attention_scaling(scaling)
        self.register_buffer("cos", (freqs.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale).to(dtype), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, H, D]`, k `[T, KVH, D]` -> rotated copies."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
