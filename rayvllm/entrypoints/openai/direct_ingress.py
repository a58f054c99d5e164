"""The replica's side of Serve's direct ingress (the replica answers HTTP
on its own port): how its port is bound."""

from __future__ import annotations

import socket
from types import ModuleType
from typing import Any


class _ReuseAddressSockets:
    """The `socket` module as Serve's HTTP server code sees it once
    `bind_direct_ingress_with_reuse_address` ran: sockets come with
    SO_REUSEADDR; everything else is the real module."""

    def __init__(self, real: ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def socket(self, *args: Any, **kwargs: Any) -> socket.socket:
        sock = self._real.socket(*args, **kwargs)
        sock.setsockopt(self._real.SOL_SOCKET, self._real.SO_REUSEADDR, 1)
        return sock


def bind_direct_ingress_with_reuse_address() -> None:
    """Call in the replica before Serve starts its direct-ingress server.

    Serve binds that port without SO_REUSEADDR. A replica killed with
    connections open leaves them in TCP TIME_WAIT on the port for up to a
    minute, so its replacement's bind fails, Serve blocks the port, and the
    deployment stays down 60-90 s instead of the seconds a replica takes to
    start. SO_REUSEADDR (which uvicorn and other servers set) binds over
    TIME_WAIT and is still refused while another socket listens there."""
    from ray.serve._private import http_util

    if not isinstance(http_util.socket, _ReuseAddressSockets):
        http_util.socket = _ReuseAddressSockets(http_util.socket)  # type: ignore[assignment]
