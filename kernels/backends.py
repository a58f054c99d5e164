"""Attention backends: who stores a step's K/V in the paged cache, who
attends over it, in which cache layout, and from which metadata.

Three implementations:

* `torch`: the reference (`kernels/reference.py`) plus, on float32 CPU, the
  C decode kernel. The CPU product path and the oracle; runs anywhere.
* `triton`: one varlen Triton kernel for decodes and prefills over a cached
  prefix (`kernels/triton_attention.py`). CUDA; on the CPU only under the
  Triton interpreter, which is for tests.
* `flash_attn`: flash-attn 2's `flash_attn_varlen_func` over the paged cache
  (its `block_table` argument), with K/V written by the Triton kernel.

`select_attention_backend` picks one by device and availability, or takes
the `attention_backend` override.
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from rayvllm.config import ATTENTION_BACKEND_ENV, ATTENTION_BACKENDS
from rayvllm.kernels import reference
from rayvllm.kernels.kv_layout import KVCacheLayout, Shape, kv_cache_shapes
from rayvllm.kernels.metadata import AttentionMetadata, VarlenMetadata
from rayvllm.messages.errors import InvalidParameterError

def _importable(module: str) -> bool:
    """Whether `module` imports (not merely exists: a flash-attn wheel built
    for another torch or CUDA fails at import)."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def _triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_gpu_kernels_apply(device: str, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` runs kernels/triton_fused.py:
    on CUDA, in half precision (float32 is the parity mode and keeps torch's
    ops), where Triton imports."""
    return (
        torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16) and _importable("triton")
    )


class AttentionBackend(ABC):
    """A backend instance is shared by every attention layer of a runner.

    Contract: `reshape_and_cache` runs before `forward` in each layer (unless
    the model stored K/V itself, see `fused_cpu_kv_write`), and `forward`
    returns the attention output `[T, num_heads, head_size]` of the flat
    batch, each query attending causally to its sequence's keys."""

    name: ClassVar[str]
    kv_layout: ClassVar[KVCacheLayout]
    # True: the runner builds `AttentionMetadata.varlen`; False: the torch
    # reference's fields (decode index/mask or block-table rows, prefills).
    uses_varlen_metadata: ClassVar[bool]
    # A decode forward reads only device tensors and syncs nothing, so a
    # CUDA graph can capture it.
    supports_cuda_graphs: ClassVar[bool]
    # The model may store K/V itself with the fused float32 CPU RoPE +
    # cache-write kernel (which writes the SPLIT layout).
    fused_cpu_kv_write: ClassVar[bool]
    # `forward` takes a layer's sliding window, and a soft cap on its
    # attention logits (the runner refuses a model that needs either on a
    # backend without it).
    supports_sliding_window: ClassVar[bool] = False
    supports_softcap: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def unavailable_reason(
        cls, device_type: str, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        """Why this backend cannot run here, or None if it can."""

    def kv_cache_shapes(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[Shape, Shape]:
        return kv_cache_shapes(self.kv_layout, num_blocks, block_size, num_kv_heads, head_size)

    @abstractmethod
    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """Store `key`/`value` `[T, kv_heads, head_size]` at `metadata.slot_mapping` (-1: skip)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """`key`/`value` are the step's new K/V, already stored in the cache.
        `window`: the layer's sliding window (None: full attention); a
        backend without `supports_sliding_window` is never given one.
        `softcap` c: each scaled score s counts as c * tanh(s / c) (None:
        as it is); only a backend with `supports_softcap` is given one."""


class TorchBackend(AttentionBackend):
    """The reference path, unchanged: on float32 CPU the runner gives decodes
    block-table rows for the C kernel, else a gathered index and mask."""

    name = "torch"
    kv_layout = KVCacheLayout.SPLIT
    uses_varlen_metadata = False
    supports_cuda_graphs = False
    fused_cpu_kv_write = True
    supports_sliding_window = True
    supports_softcap = True

    @classmethod
    def unavailable_reason(
        cls, device_type: str, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        return None

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        reference.reshape_and_cache(
            key, value, key_cache, value_cache, metadata.slot_mapping, metadata.has_negative_slots
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return reference.paged_attention(query, key, value, key_cache, value_cache, metadata, scale, window, softcap)


def _varlen(metadata: AttentionMetadata) -> VarlenMetadata:
    assert metadata.varlen is not None, "varlen backend given metadata without its varlen fields"
    return metadata.varlen


class _NHDTritonWriteBackend(AttentionBackend):
    """The GPU backends' shared half: NHD caches (a key's head_size values
    contiguous, so a tile's loads coalesce on the GPU), varlen metadata, and
    the Triton store kernel, which skips slots of -1 itself."""

    kv_layout = KVCacheLayout.NHD
    uses_varlen_metadata = True
    supports_cuda_graphs = True
    fused_cpu_kv_write = False

    def __init__(self) -> None:
        from rayvllm.kernels import triton_kv_cache

        self._write = triton_kv_cache.reshape_and_cache

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        self._write(key, value, key_cache, value_cache, metadata.slot_mapping, self.kv_layout)


class TritonBackend(_NHDTritonWriteBackend):
    """Triton's varlen paged-attention kernel over the NHD caches."""

    name = "triton"
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self) -> None:
        super().__init__()
        from rayvllm.kernels import triton_attention

        self._attend = triton_attention.paged_attention

    @classmethod
    def unavailable_reason(
        cls, device_type: str, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        if not _importable("triton"):
            return "the triton package does not import"
        if device_type == "cpu" and not _triton_interpreting():
            return "Triton needs CUDA; on the CPU it runs only under its interpreter (TRITON_INTERPRET=1, for tests)"
        if device_type not in ("cuda", "cpu"):
            return f"Triton does not run on {device_type!r}"
        return None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        v = _varlen(metadata)
        return self._attend(
            query,
            key_cache,
            value_cache,
            query_start_loc=v.query_start_loc,
            seq_lens=v.seq_lens,
            block_tables=v.block_table,
            max_query_len=v.max_query_len,
            max_seq_len=v.max_seq_len,
            scale=scale,
            layout=self.kv_layout,
            window=window,
            softcap=softcap,
        )


# flash-attn 2 (`flash_attn` on PyPI) checks these in mha_varlen_fwd: a paged
# cache's block size must be a multiple of 256, head size at most 256 (and a
# multiple of 8, or the wrapper pads q/k/v per call, which a cache cannot be),
# and only half types.
_FLASH_BLOCK_MULTIPLE = 256
_FLASH_MAX_HEAD_SIZE = 256
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttnBackend(_NHDTritonWriteBackend):
    """flash-attn 2's public `flash_attn_varlen_func(q, k, v, cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k, ..., causal, block_table)`:
    with a block table, `k`/`v` are the NHD caches and `cu_seqlens_k` the
    cumulative context lengths; causal masking is aligned to the bottom
    right, i.e. query i of a sequence sees keys `<= i + seq_len - q_len`,
    which is our positions' rule. (vLLM's fork takes `seqused_k` instead of
    `cu_seqlens_k`; the `flash_attn` package does not accept it.) A sliding
    window of W keys is its `window_size=(W - 1, 0)` (keys `p - (W - 1) ..
    p`), a cap its `softcap` (flash-attn 2.6 on); neither is passed when the
    layer has none, so older versions serve every other model."""

    name = "flash_attn"
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self) -> None:
        super().__init__()
        import flash_attn

        self._attend = flash_attn.flash_attn_varlen_func

    @classmethod
    def unavailable_reason(
        cls, device_type: str, dtype: torch.dtype, head_size: int, block_size: int
    ) -> str | None:
        if device_type != "cuda":
            return "flash-attn needs CUDA"
        if dtype not in _FLASH_DTYPES:
            return f"flash-attn supports float16 and bfloat16, not {dtype}"
        if head_size % 8 or head_size > _FLASH_MAX_HEAD_SIZE:
            return f"flash-attn needs a head size that is a multiple of 8 and at most 256, got {head_size}"
        if block_size % _FLASH_BLOCK_MULTIPLE:
            return f"flash-attn's paged KV cache needs block_size a multiple of 256, got {block_size}"
        if not _importable("flash_attn"):
            return "the flash_attn package does not import"
        if not _importable("triton"):
            return "the triton package (which writes its KV cache) does not import"
        return None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        v = _varlen(metadata)
        extra: dict[str, object] = {}
        if window is not None:
            extra["window_size"] = (window - 1, 0)
        if softcap is not None:
            extra["softcap"] = softcap
        return self._attend(
            query,
            key_cache,
            value_cache,
            cu_seqlens_q=v.query_start_loc,
            cu_seqlens_k=v.seq_start_loc,
            max_seqlen_q=v.max_query_len,
            max_seqlen_k=v.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=v.block_table,
            **extra,
        )


_BY_NAME: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (TorchBackend, TritonBackend, FlashAttnBackend)
}


def select_attention_backend(
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    override: str = "auto",
    windowed: bool = False,
    softcapped: bool = False,
) -> AttentionBackend:
    """"auto": flash_attn on CUDA where it imports and supports the shapes
    (and, for a model with sliding-window layers, `windowed`, the window;
    for one with capped attention logits, `softcapped`, the cap),
    else triton on CUDA where it imports, else torch (always on the CPU).
    Any other name forces that backend, or raises an InvalidParameterError
    naming `attention_backend` and saying why it cannot run here."""
    device_type = torch.device(device).type
    if override == "auto":
        if device_type == "cuda":
            for candidate in (FlashAttnBackend, TritonBackend):
                if (windowed and not candidate.supports_sliding_window) or (
                    softcapped and not candidate.supports_softcap
                ):
                    continue
                if candidate.unavailable_reason(device_type, dtype, head_size, block_size) is None:
                    return candidate()
        return TorchBackend()
    cls = _BY_NAME.get(override)
    if cls is None:
        raise InvalidParameterError(
            "attention_backend", f"unknown backend {override!r}; expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    reason = cls.unavailable_reason(device_type, dtype, head_size, block_size)
    if reason is not None:
        raise InvalidParameterError(
            "attention_backend",
            f"{override!r} cannot run here: {reason} (from the attention_backend argument or "
            f"{ATTENTION_BACKEND_ENV}; 'auto' picks one that can)",
        )
    return cls()
