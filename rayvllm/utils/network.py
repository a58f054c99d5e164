"""Ports: a free one for a listener this process or a peer will open."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the OS had free just now (another process may take it before
    it is bound again: callers that can, bind 0 themselves)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
