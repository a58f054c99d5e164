"""Host tensors on transparent huge pages, for the large buffers a CPU step
streams through: packed and transposed weights and the KV cache.

A decode step reads every weight and most of the KV cache once, from memory.
On 4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetcher
stops at each page boundary; on 2 MiB pages a 400 MB weight set streamed
through the packed GEMM up to 15% faster at 4 rows, and the 125M model's
offline round ~2.5% faster (docs/BENCHMARKS.md, issue 14). Linux
backs an anonymous range with huge pages when it is 2 MiB-aligned and
`madvise(MADV_HUGEPAGE)` was called before its first touch, which works in
the kernel's default `madvise` mode. Elsewhere, or when the call fails, the
tensor is an ordinary one.
"""

from __future__ import annotations

import ctypes
import math
import sys
from functools import lru_cache

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# glibc mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit (half its heap size).
_MMAP_THRESHOLD_MAX = 32 << 20


def _glibc(name: str, argtypes: list[type], restype: type = ctypes.c_int) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """One of glibc's malloc functions, or None where there is none (not Linux, another libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it
    back to the OS, so a step's large activations do not page-fault into
    fresh pages every step (what vLLM's advice to preload tcmalloc is for).
    The mmap threshold goes to its maximum (32 MiB) and stops adapting, and
    the heap is never trimmed: the process keeps its peak heap. Measured on
    the 125M offline round, +4% (docs/BENCHMARKS.md, issue 14). Returns
    whether glibc took both settings; elsewhere it does nothing."""
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    trim = mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    return bool(trim and mmap)


def return_freed_memory() -> bool:
    """Hand the memory that freed tensors left in glibc's heap back to the
    OS (`malloc_trim`), where `keep_freed_memory` would keep it: for a
    sleeping engine, whose freed weights and KV cache must really leave
    the process (large blocks are mapped and return at their free anyway).
    Returns whether glibc did it; elsewhere it does nothing."""
    malloc_trim = _glibc("malloc_trim", [ctypes.c_size_t])
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`torch.empty(shape, dtype)` on the CPU whose whole 2 MiB pages are
    huge pages where the OS allows it. The view keeps its over-allocated
    buffer alive; the slack (< 2 MiB) is never touched, so it costs address
    space, not memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + offset, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype).view(shape)
