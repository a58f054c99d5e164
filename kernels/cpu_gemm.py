"""float32 CPU GEMM against a weight packed once at load (`csrc_gemm.c`),
for the few-row products of decode steps, which MKL runs memory-bound by
repacking the weight on every call.

The library is built per instruction-set variant (kernels/cpu_isa.py); the
packed layout's tile width differs between variants, so a packed weight is
only ever multiplied by the variant that packed it (checked). Callers check
`available()` and keep torch's GEMM otherwise; which of them wins at which
row count is decided at load by kernels/gemm_select.py.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from rayvllm.kernels.cbuild import load_library
from rayvllm.kernels.cpu_isa import selected_isa
from rayvllm.kernels.host_memory import empty_huge


@lru_cache(maxsize=None)
def _library(isa: str) -> ctypes.CDLL | None:
    lib = load_library("csrc_gemm.c", [], isa)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pack_weight_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    lib.transpose_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    lib.gemm_packed_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.gemm_tile_cols.restype = i64
    lib.tile = int(lib.gemm_tile_cols())
    return lib


@lru_cache(maxsize=1)
def default_isa() -> str:
    return selected_isa()


def available(isa: str | None = None) -> bool:
    return _library(isa or default_isa()) is not None


def library_id(isa: str | None = None) -> str:
    """The built library's file name, which names its source, flags, compiler
    and CPU (kernels/cbuild.py): a plan timed against another build is stale."""
    lib = _library(isa or default_isa())
    assert lib is not None
    return Path(lib._name).name


def tile_cols(isa: str | None = None) -> int:
    """Columns per packed tile of `isa`'s build (32 / 16 / 8 for AVX-512 / AVX2 / baseline)."""
    lib = _library(isa or default_isa())
    assert lib is not None
    return lib.tile


def pack_weight(weight: torch.Tensor, isa: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` `[N, K]` float32 as column tiles `[ceil(N / TILE), K, TILE]` for `isa`'s kernel,
    into `out` (a tensor of that shape, e.g. the weight's earlier packing) where given."""
    lib = _library(isa or default_isa())
    assert lib is not None and weight.dtype == torch.float32
    weight = weight.detach().contiguous()
    n, k = weight.shape
    shape = (-(-n // lib.tile), k, lib.tile)
    if out is not None and (tuple(out.shape) != shape or not out.is_contiguous() or out.dtype != torch.float32):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}, got {tuple(out.shape)}")
    packed = empty_huge(shape) if out is None else out
    lib.pack_weight_f32(weight.data_ptr(), packed.data_ptr(), n, k, torch.get_num_threads())
    return packed


def transpose(weight: torch.Tensor, out: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """`out` (contiguous float32 `[K, N]`) filled with `weight` `[N, K]` transposed."""
    lib = _library(isa or default_isa())
    assert lib is not None and weight.dtype == torch.float32
    weight = weight.detach().contiguous()
    n, k = weight.shape
    if tuple(out.shape) != (k, n) or not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 tensor of shape {(k, n)}, got {tuple(out.shape)}")
    lib.transpose_f32(weight.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return out


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, isa: str | None = None) -> torch.Tensor:
    """`x @ W^T` `[M, n]` for the `W` that `packed` came from (packed for the same `isa`)."""
    lib = _library(isa or default_isa())
    assert lib is not None
    x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] == k and packed.shape[2] == lib.tile and x.dtype == torch.float32
    y = torch.empty(m, n)
    lib.gemm_packed_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y
