"""The OpenMP runtime that torch and the C kernels share (torch's libgomp).

libgomp keeps one thread team per thread that ever ran a parallel region,
and once the process holds more OpenMP threads than CPUs it throttles every
team's spin-wait, so each parallel region then pays a futex wake. A
process that loads the model on one thread and steps on another (an actor's
channel or loop thread, the serving step thread) hits exactly that: the
load leaves the first thread's team behind, and every op of every step
runs slower, small ones by 3-10x (docs/BENCHMARKS.md). Releasing the
loading thread's team once the steps move elsewhere avoids it.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

# omp_pause_resource_all's "hard" kind: free the threads, not just idle them.
_OMP_PAUSE_HARD = 2


@lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp already in this process (torch's), or None: loading a
    second copy would only release threads nobody uses."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None
    return lib if hasattr(lib, "omp_pause_resource_all") else None


def release_thread_team() -> bool:
    """Free the OpenMP threads of the calling thread's team (they are made
    again if this thread runs a parallel region later). ModelRunner calls
    it at the end of setup, on the thread that loaded the model. Returns
    whether the runtime did it (False: no libgomp here, or inside a region)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
