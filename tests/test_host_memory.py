"""Host buffers for the CPU path: huge-page-backed tensors and the malloc
setting that keeps freed memory for reuse (kernels/host_memory.py)."""

from __future__ import annotations

import sys

import pytest
import torch


def test_empty_huge_is_aligned_and_usable() -> None:
    """Large buffers start on a 2 MiB boundary (where huge pages can back
    them) and behave as ordinary tensors; small ones are plain tensors."""
    from rayvllm.kernels.host_memory import HUGE_PAGE, empty_huge

    big = empty_huge((3, 1 << 20))
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and big.is_contiguous()
    if sys.platform.startswith("linux"):
        assert big.data_ptr() % HUGE_PAGE == 0
    big.fill_(2.0)
    assert float(big.sum()) == 2.0 * 3 * (1 << 20)
    small = empty_huge((4, 5), torch.int64)
    assert small.shape == (4, 5) and small.dtype == torch.int64


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_takes_on_glibc() -> None:
    """Both malloc settings are accepted where glibc is the allocator (the
    values are within its bounds), and calling it again is harmless."""
    import platform

    from rayvllm.kernels.host_memory import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert keep_freed_memory() and keep_freed_memory()
