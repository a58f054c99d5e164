"""Paged attention layer: writes the step's K/V to the cache, then attends,
both through the runner's attention backend (kernels/backends.py)."""

from __future__ import annotations

import torch
from torch import nn

from rayvllm.kernels.backends import AttentionBackend
from rayvllm.kernels.metadata import AttentionMetadata


class Attention(nn.Module):
    """The KV cache tensors and the backend that owns their layout are bound
    by the model runner (`bind_kv_cache`) after it sizes the pool; before
    that the layer cannot run."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """`window`: a sliding window of that many keys (None: full attention);
        `softcap` c: scaled scores s count as c * tanh(s / c) (None: as they are)."""
        super().__init__()
        self.window = window
        self.softcap = softcap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def bind_kv_cache(self, key_cache: torch.Tensor, value_cache: torch.Tensor, backend: AttentionBackend) -> None:
        self.key_cache = key_cache
        self.value_cache = value_cache
        self.backend = backend

    def unbind_kv_cache(self) -> None:
        """Drop the references to the caches (a sleeping engine frees them)."""
        self.key_cache = None
        self.value_cache = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """`kv_written`: the caller's fused kernel already stored k/v in the cache."""
        backend = self.backend
        assert backend is not None, "KV cache not bound"
        if not kv_written:
            backend.reshape_and_cache(k, v, self.key_cache, self.value_cache, metadata)
        return backend.forward(
            q, k, v, self.key_cache, self.value_cache, metadata, self.scale, self.window, self.softcap
        )
