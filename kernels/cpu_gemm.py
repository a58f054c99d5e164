"""float32 CPU GEMM against a weight packed once at load (`csrc_gemm.c`),
for the few-row products of decode steps, which MKL runs memory-bound by
repacking the weight on every call. Callers check `available()` and keep
torch's GEMM otherwise."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from rayvllm.kernels.cbuild import load_library

# Columns per packed tile (TILE in csrc_gemm.c).
TILE = 32


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = load_library("csrc_gemm.c", [])
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pack_weight_f32.argtypes = [ptr, ptr, i64, i64]
    lib.gemm_packed_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    return lib


def available() -> bool:
    return _library() is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` float32 as column tiles `[ceil(N / TILE), K, TILE]`."""
    lib = _library()
    assert lib is not None and weight.dtype == torch.float32
    weight = weight.detach().contiguous()
    n, k = weight.shape
    packed = torch.empty(-(-n // TILE), k, TILE)
    lib.pack_weight_f32(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`x @ W^T` `[M, n]` for the `W` that `packed` came from."""
    lib = _library()
    assert lib is not None
    x = x.contiguous()
    m, k = x.shape
    assert packed.shape[1] == k and x.dtype == torch.float32
    y = torch.empty(m, n)
    lib.gemm_packed_f32(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y
