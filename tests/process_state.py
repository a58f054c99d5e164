"""What /proc says of processes the tests started: which run below a
process, their threads' niceness, the environment each started with."""

from __future__ import annotations

import os
from pathlib import Path


def descendant_pids(root: int) -> list[int]:
    """Processes below `root` in the process tree, at any depth."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name in parentheses may hold spaces: split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def descendants_running(root: int, cmdline_part: str) -> list[int]:
    """Processes below `root` whose command line contains `cmdline_part`."""
    found = []
    for pid in descendant_pids(root):
        try:
            raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline_part in raw.replace(b"\0", b" ").decode(errors="replace"):
            found.append(pid)
    return found


def thread_niceness(pid: int) -> set[int]:
    """The niceness of every thread of process `pid` (Linux keeps it per thread)."""
    levels = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            levels.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return levels


def start_environment(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (what it read its settings from)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw.split(b"\0") if entry)
    return {name: value for name, _, value in pairs}
