"""What /proc says of a process the tests started: its threads' niceness."""

from __future__ import annotations

import os


def thread_niceness(pid: int) -> set[int]:
    """The niceness of every thread of process `pid` (Linux keeps it per thread)."""
    levels = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            levels.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return levels
