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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torch's libgomp")
def test_release_thread_team_frees_the_threads_and_parallel_ops_still_work() -> None:
    """torch's libgomp is found in this process and frees the calling
    thread's team (its worker threads end); the next parallel region makes
    a team again and computes the same result."""
    import os
    import threading

    from rayvllm.kernels.omp_runtime import release_thread_team

    x = torch.arange(1 << 18, dtype=torch.float32)
    before = torch.get_num_threads()
    results: list[tuple[int, int, bool, float]] = []

    def in_a_fresh_thread() -> None:
        # A thread of our own, so the team and its threads are this test's.
        torch.set_num_threads(2)
        expected = float(x.sum())
        with_team = len(os.listdir("/proc/self/task"))
        released = release_thread_team()
        results.append((with_team, len(os.listdir("/proc/self/task")), released, float(x.sum()) - expected))

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    with_team, after_release, released, difference = results[0]
    assert released and after_release < with_team and difference == 0.0
    assert torch.get_num_threads() == before
