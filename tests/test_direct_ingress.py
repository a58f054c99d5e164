"""How a direct-ingress replica binds its port: over connections a killed
predecessor left in TCP TIME_WAIT (which Serve's own bind refuses, keeping
the replacement off the air for up to a minute), never over a listener.
Linux lets a bind pass a TIME_WAIT socket only when both had SO_REUSEADDR,
so the predecessor's listener is made the same way here."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from rayvllm.entrypoints.openai.direct_ingress import bind_direct_ingress_with_reuse_address
from rayvllm.utils.network import free_port

http_util = pytest.importorskip("ray.serve._private.http_util")

SocketFactory = Callable[..., socket.socket]


def _leave_time_wait(make_socket: SocketFactory, port: int) -> None:
    """A listener on `port` from `make_socket`, and a connection to it that
    the listener's end closes first: that end stays in TIME_WAIT after both
    sides have closed."""
    with make_socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()
        assert client.recv(1) == b""  # the server's FIN arrived
        client.close()


def test_serves_own_bind_fails_over_time_wait() -> None:
    port = free_port()
    _leave_time_wait(socket.socket, port)
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))


def test_the_replica_binds_over_time_wait_but_not_over_a_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_util, "socket", http_util.socket)  # undone after the test
    bind_direct_ingress_with_reuse_address()
    bind_direct_ingress_with_reuse_address()  # once is enough; twice changes nothing
    assert http_util.socket.socket is not socket.socket and http_util.socket.AF_INET == socket.AF_INET
    port = free_port()
    _leave_time_wait(http_util.socket.socket, port)
    with http_util.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        with http_util.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as second, pytest.raises(OSError):
            second.bind(("127.0.0.1", port))  # a live listener still owns the port
