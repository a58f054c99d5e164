"""Ports: a free one for a listener this process or a peer will open."""

from __future__ import annotations

import random
import socket

# Ports below the OS's ephemeral range that free_port picks from: above
# Ray's default worker ports (10002-19999, which a Ray node refuses to give
# any of its own components) and the well-known services below them.
_LOWEST_PICK = 20000


def _ephemeral_low() -> int:
    """The first port of the range the OS hands out to `bind(0)` and to
    outgoing connections (Linux's default where it does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free just now, for a listener bound later. Picked below the
    ephemeral range where there is room: a port in that range can be taken
    in between by any outgoing connection on the machine (an RPC client's
    local end), one below it only by another explicit pick. Callers that
    can bind 0 themselves should."""
    low = _ephemeral_low()
    if low - _LOWEST_PICK >= 1024:
        picker = random.SystemRandom()
        for _ in range(32):
            port = picker.randrange(_LOWEST_PICK, low)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
