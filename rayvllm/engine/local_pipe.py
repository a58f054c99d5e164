"""The engine loop's connection when the loop runs on a thread of the
client's own process: two in-memory queues, one each way, carrying the
same messages as the SchedulerActor's socket (`AddRequests`,
`AbortRequests` in; `EngineCoreOutputs`, `EngineCoreFailure` out) as the
objects themselves: nothing is pickled or copied on the way.

`CoreConnection` is what both ends of either kind offer the loop and its
client.
"""

from __future__ import annotations

import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Protocol

from rayvllm.distributed.rpc_channel import hang_up


class CoreConnection(Protocol):
    """Invariants: messages arrive in the order they were sent; `close`
    ends the connection for both ends at once, even while a thread of
    either end is blocked in `recv`, which then raises `EOFError` (once
    the messages sent before it are read); `send` on a closed connection
    raises `OSError`."""

    def send(self, message: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self) -> bool:
        """A message (or the end) is ready: `recv` would not block."""
        ...

    def close(self) -> None: ...


class _Pipe:
    """The shared state of one local pipe: a queue per direction and
    whether it was closed (by either end)."""

    def __init__(self) -> None:
        self.queues: tuple[deque[Any], deque[Any]] = (deque(), deque())
        self.changed = threading.Condition()
        self.closed = False


class LocalConnection:
    """One end of `local_pipe()`."""

    def __init__(self, pipe: _Pipe, side: int) -> None:
        self._pipe = pipe
        self._inbox = pipe.queues[side]
        self._outbox = pipe.queues[1 - side]

    def send(self, message: Any) -> None:
        pipe = self._pipe
        with pipe.changed:
            if pipe.closed:
                raise OSError("the local pipe is closed")
            self._outbox.append(message)
            pipe.changed.notify_all()

    def recv(self) -> Any:
        pipe = self._pipe
        inbox = self._inbox
        if inbox:  # the common case: no lock, the deque's pop is atomic
            return inbox.popleft()
        with pipe.changed:
            pipe.changed.wait_for(lambda: inbox or pipe.closed)
            if inbox:
                return inbox.popleft()
            raise EOFError("the local pipe was closed")

    def poll(self) -> bool:
        return bool(self._inbox) or self._pipe.closed

    def close(self) -> None:
        pipe = self._pipe
        with pipe.changed:
            pipe.closed = True
            pipe.changed.notify_all()


def local_pipe() -> tuple[LocalConnection, LocalConnection]:
    """Two connected ends (client, loop)."""
    pipe = _Pipe()
    return LocalConnection(pipe, 0), LocalConnection(pipe, 1)


class SocketConnection:
    """A connected socket `Connection` (the SchedulerActor's stream) as a
    `CoreConnection`: `close` hangs up, so a reader blocked on either end
    sees the end at once."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        # Bound once: the per-step calls pay no extra frame.
        self.send = conn.send
        self.recv = conn.recv
        self.poll = conn.poll

    def close(self) -> None:
        hang_up(self.conn)
