"""The C attention kernels (`csrc_paged_attention.c`): decode, and prefill
over the paged cache; built on first use (see `cbuild`)."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from rayvllm.kernels.cbuild import load_library
from rayvllm.kernels.cpu_isa import selected_isa

# Reassociation lets the dot products vectorise (summation order differs from
# torch's in the last bits, like any other attention kernel); no -ffast-math,
# whose finite-math assumption would break the -inf running max.
_FLAGS = ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


@lru_cache(maxsize=None)
def _library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for `isa` (default: the variant kernels/cpu_isa.py selects)."""
    lib = load_library("csrc_paged_attention.c", _FLAGS, isa)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.paged_attention_decode_f32, lib.paged_attention_prefill_f32):
        fn.argtypes = [ptr] * 5 + [i64, ptr, ptr] + [i64] * 6 + [ctypes.c_float, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
    return lib


def available(isa: str | None = None) -> bool:
    return _library(isa) is not None


def supports(head_size: int, block_size: int) -> bool:
    """Shapes the decode kernel handles: head size a multiple of 4, block size <= 256."""
    return head_size % 4 == 0 and block_size <= 256 and available()


def supports_prefill(head_size: int, block_size: int) -> bool:
    """Where the engine runs the prefill kernel: block size 16, head size a
    multiple of 16, and the AVX-512 build. The AVX2 and portable builds are
    correct but slower than torch's SDPA (docs/BENCHMARKS.md), so prefills
    stay on SDPA there."""
    return block_size == 16 and head_size % 16 == 0 and selected_isa() == "avx512" and available()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    isa: str | None = None,
    prefill: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query `[T, H, D]` float32, one query token per row; token t attends to
    keys `0 .. ctx_lens[t]-1` of block-table row `seq_rows[t]` (with a
    `window` of W keys, to `ctx_lens[t]-W .. ctx_lens[t]-1` only, and no
    block before its first key is read: it may have been freed); with a
    `softcap` c, each scaled score s counts as c * tanh(s / c). The decode
    kernel takes tokens in any order; with `prefill`, the prefill kernel
    (only where `supports_prefill`) takes the tokens of prefills, each
    sequence's consecutive, so that runs of them share every key and value
    load, and gives each token the decode kernel's bits."""
    name = "paged_attention_prefill_f32" if prefill else "paged_attention_decode_f32"
    lib = _library(isa)
    assert lib is not None, "CPU attention kernel unavailable"
    assert query.dtype == torch.float32 and key_cache.dtype == torch.float32
    query = query.contiguous()
    out = torch.empty_like(query)
    num_tokens, num_heads, head_size = query.shape
    _, block_size, kv_heads, _ = value_cache.shape
    assert key_cache.shape[1:] == (kv_heads, head_size, block_size)
    assert block_tables.dtype == seq_rows.dtype == ctx_lens.dtype == torch.int64
    assert block_tables.is_contiguous() and seq_rows.is_contiguous() and ctx_lens.is_contiguous()
    code = getattr(lib, name)(
        query.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), seq_rows.data_ptr(), ctx_lens.data_ptr(),
        num_tokens, num_heads, kv_heads, head_size, block_size, window or 0, softcap or 0.0, scale,
        torch.get_num_threads(),
    )
    assert code == 0, f"{name}: unsupported shape (block size {block_size}, head size {head_size})"
    return out
