"""A direct, authenticated TCP channel for the per-step hot path.

Ray sets up the processes and hands each side the address and key; the
steps themselves then skip Ray. Measured on the 2-core dev box: a plain Ray
actor call round trip costs ~1.5 ms (3.5 ms for the engine loop ->
scheduler -> worker chain), a Ray Compiled Graph ~0.3 ms but its idle
readers spin at 60-70% of a core each, taking the cores the forward needs;
this channel blocks in the kernel while waiting and costs ~0.1 ms.

A channel carries one kind of message to one handler (a worker's
`execute_model` with each `SchedulerOutput`): no method names travel, so
nothing but that handler can be reached through it. The server handles
messages one at a time, in arrival order, on its own thread, so a client may
send several before reading the first reply (pipeline stages overlap that
way). Replies come back in the same order. The engine
loop's connection (engine/core_loop.py) is a plain two-way stream made with
`open_listener` / `accept` / `connect`, not a call channel.
"""

from __future__ import annotations

import pickle
import secrets
import socket
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Generic, TypeVar

Message = TypeVar("Message")
Reply = TypeVar("Reply")


def _no_delay(conn: Connection) -> None:
    # Large messages go out as header + payload; without TCP_NODELAY Nagle
    # and delayed ACKs can hold the payload for tens of milliseconds.
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()


def hang_up(conn: Connection) -> None:
    """Close `conn` so that the peer sees the end at once, even while another
    thread of ours is blocked reading it (a plain close leaves the socket
    open until that read returns). Hanging up twice is a no-op (a restart
    that waits for room tries again on a connection it already closed)."""
    if conn.closed:
        return
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already down
    finally:
        sock.detach()
    conn.close()


def open_listener(host: str) -> tuple[Listener, bytes]:
    """A listener on a free port of `host` and the key a client must show."""
    authkey = secrets.token_bytes(32)
    return Listener((host, 0), authkey=authkey), authkey


def accept(listener: Listener) -> Connection:
    conn = listener.accept()
    _no_delay(conn)
    return conn


def connect(address: tuple[str, int], authkey: bytes) -> Connection:
    conn = Client(address, authkey=authkey)
    _no_delay(conn)
    return conn


class ChannelServer(Generic[Message, Reply]):
    """Serves `handler(message)` for one client. Invariant: at most one
    message is handled at a time, on the server thread (`on_thread_start`
    runs there first, e.g. to size that thread's OpenMP pool)."""

    def __init__(
        self, handler: Callable[[Message], Reply], host: str, on_thread_start: Callable[[], None] | None = None
    ) -> None:
        self.handler = handler
        self._listener, self.authkey = open_listener(host)
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self._on_thread_start = on_thread_start
        self._conn: Connection | None = None
        self._thread = threading.Thread(target=self._serve, name="rayvllm-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._on_thread_start is not None:
            self._on_thread_start()
        try:
            conn = self._conn = accept(self._listener)
        except OSError:
            return  # closed before a client came
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            try:
                reply: tuple[bool, Any] = (True, self.handler(message))
            except BaseException as e:  # noqa: BLE001 - the client re-raises it
                reply = (False, e)
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError):
                conn.send((False, RuntimeError(traceback.format_exc())))
            except OSError:
                return

    def close(self) -> None:
        self._listener.close()
        if self._conn is not None:
            self._conn.close()


class ChannelClient(Generic[Message, Reply]):
    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self._conn = connect(address, authkey)

    def send(self, message: Message) -> None:
        self._conn.send(message)

    def send_pickled(self, message: bytes) -> None:
        """A message pickled once (`pickle_message`) and sent to several servers."""
        self._conn.send_bytes(message)

    @property
    def connection(self) -> Connection:
        """For `multiprocessing.connection.wait` over several channels."""
        return self._conn

    def poll(self) -> bool:
        """A reply (or the end of the connection) is ready to `recv`."""
        try:
            return self._conn.poll()
        except (EOFError, OSError):
            return True  # `recv` raises the error

    def recv(self) -> Reply:
        """The reply to the oldest unanswered message; re-raises its exception."""
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def call(self, message: Message) -> Reply:
        self.send(message)
        return self.recv()

    def close(self) -> None:
        self._conn.close()


def pickle_message(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
