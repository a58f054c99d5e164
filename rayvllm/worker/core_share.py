"""How many torch threads a CPU rank runs: the node's cores shared evenly
among the engine ranks busy on it.

Engines on one node do not know of each other: two Serve replicas, a batch
replica beside a server, an offline `LLM` beside either. Each sizing its
OpenMP pool to every core oversubscribes the cores, and OpenMP pools that
share cores stall each other at every barrier (docs/BENCHMARKS.md, the
two-replica runs). So each rank keeps a file in a node-local directory,
touched while it steps, and sizes its pool to its share of ``cores`` among
the busy ranks (the remainder of the division to the first of them, so the
shares add up to ``cores``). A rank idle for `BUSY_WINDOW_S` stops counting,
so an engine busy alone gets every core back; the file of a rank whose
process died is removed by whichever rank notices.

Invariant: a rank counts itself, so `threads()` is between 1 and `cores`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import time
from pathlib import Path

# A rank that has not stepped for this long is idle; the directory is read
# at most every REFRESH_S per rank.
BUSY_WINDOW_S = 1.0
REFRESH_S = 0.25
_DIRECTORY_NAME = "rayvllm-busy-ranks"
_rank_ids = itertools.count()


def node_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's
    or a `taskset`'s limit, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_directory() -> Path:
    """Where the ranks of this node (this machine's temporary directory) keep their files."""
    return Path(tempfile.gettempdir()) / _DIRECTORY_NAME


def _make_shared_directory(directory: Path) -> None:
    """`directory`, writable by every user of the node and sticky (each
    removes only its own files, as in /tmp): engines run by different users
    (a cluster launcher's user beside a local one) share the cores too."""
    try:
        directory.mkdir(parents=True)
    except FileExistsError:
        return
    directory.chmod(0o1777)  # mkdir's mode is cut by the umask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class CoreShare:
    """One rank's share of its node's cores; `threads()` before each step."""

    def __init__(self, directory: Path | None = None, cores: int | None = None) -> None:
        self.directory = directory or default_directory()
        self.cores = cores or node_cores()
        name = f"{os.getpid()}.{next(_rank_ids)}"
        try:
            _make_shared_directory(self.directory)
            (self.directory / name).touch()
        except PermissionError:
            # Another user made it without the shared mode: count with this user's engines only.
            self.directory = self.directory.with_name(f"{self.directory.name}-{os.getuid()}")
            _make_shared_directory(self.directory)
            (self.directory / name).touch()
        self._file = self.directory / name
        self._key = _key(name)
        os.utime(self._file, (0, 0))  # idle until its first step
        self._checked_at = -float("inf")
        self._threads = self.cores

    def threads(self, now: float | None = None) -> int:
        """Mark this rank busy and return its thread count (re-read from the
        directory at most every `REFRESH_S`)."""
        now = time.time() if now is None else now
        if now - self._checked_at >= REFRESH_S:
            self._checked_at = now
            self._file.touch()  # again, should someone have removed it
            os.utime(self._file, (now, now))
            busy = self._busy(now)
            base, extra = divmod(self.cores, max(1, len(busy)))
            # The cores that do not divide evenly go to the first ranks in
            # an order every rank computes alike.
            position = busy.index(self._key) if self._key in busy else len(busy)
            self._threads = max(1, base + (position < extra))
        return self._threads

    def close(self) -> None:
        self._file.unlink(missing_ok=True)

    def _busy(self, now: float) -> list[tuple[int, int]]:
        """The busy ranks' keys (pid, index in their process), in order."""
        busy = []
        for entry in os.scandir(self.directory):
            try:
                key = _key(entry.name)
                touched = entry.stat().st_mtime
            except (ValueError, FileNotFoundError):
                continue  # not ours, or gone meanwhile
            if not _alive(key[0]):
                with contextlib.suppress(OSError):  # another user's, in the sticky directory
                    Path(entry.path).unlink()
            elif now - touched < BUSY_WINDOW_S:
                busy.append(key)
        return sorted(busy)


def _key(name: str) -> tuple[int, int]:
    """A rank file's name, `pid.index`, as numbers (ValueError if it is not one)."""
    pid, index = name.split(".", 1)
    return int(pid), int(index)
