"""Chat templates sent by clients, rendered where they cannot hurt the server.

A template is code. transformers renders it in jinja's sandbox, which keeps
it away from Python internals but not from loops of a billion steps or a
string of gigabytes: on the server's event loop either would stall every
request. So a request's own template (accepted only with the operator's
`trust_request_chat_template`) renders in a child process that holds the
tokenizer, one render at a time, under a wall-clock limit and an address
space limit; a child that overruns either is killed and the request gets a
400 naming `chat_template`. The server's own template (the tokenizer's) is
the operator's code and renders in-process as before.

Invariant: at most one child exists per renderer, and it is either idle or
rendering exactly one request; after a timeout or a crash there is none
until the next request starts a fresh one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from rayvllm.messages.errors import InvalidParameterError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A chat template renders in milliseconds; seconds mean a loop meant to hang.
RENDER_TIMEOUT_S = 5.0
# Address space a child may add after loading the tokenizer.
RENDER_MEMORY_BYTES = 1 << 30
# Longer text is no prompt any model takes; it is not sent back whole.
MAX_RENDERED_CHARS = 32 << 20
# A child's first start (spawn, imports, tokenizer) is not the template's time.
START_TIMEOUT_S = 120.0

__all__ = ["ClientTemplateRenderer"]


class ClientTemplateRenderer:
    """Renders conversations with client templates in a child process."""

    def __init__(
        self, tokenizer: "PreTrainedTokenizerBase", timeout_s: float = RENDER_TIMEOUT_S,
        memory_bytes: int = RENDER_MEMORY_BYTES,
    ) -> None:
        self._tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._child: BaseProcess | None = None
        self._conn: Connection | None = None
        self._lock = asyncio.Lock()

    async def render(self, messages: Sequence[Mapping[str, Any]], options: Mapping[str, Any]) -> str:
        """`processor.render_chat(tokenizer, messages, **options)` in the child."""
        async with self._lock:
            conn = await self._ready_connection()
            conn.send((list(messages), dict(options)))
            try:
                answered = await asyncio.to_thread(conn.poll, self.timeout_s)
                reply = conn.recv() if answered else None
            except (EOFError, OSError):
                answered, reply = True, None  # the child died: out of memory, or worse
            if reply is None:
                self._stop_child()
                why = f"rendering took longer than {self.timeout_s:g} s" if not answered else (
                    "rendering exceeded the memory allowed to a chat template"
                )
                raise InvalidParameterError("chat_template", why)
        kind, field, payload = reply
        if kind == "error":
            raise InvalidParameterError(field, payload)
        return payload

    def close(self) -> None:
        self._stop_child()

    async def _ready_connection(self) -> Connection:
        if self._conn is not None and self._child is not None and self._child.is_alive():
            return self._conn
        self._stop_child()
        ctx = multiprocessing.get_context("spawn")
        parent, child_end = ctx.Pipe()
        child = ctx.Process(
            target=_serve, args=(child_end, self._tokenizer, self.memory_bytes), name="rayvllm-template", daemon=True
        )
        child.start()
        child_end.close()
        self._child, self._conn = child, parent
        try:
            if not await asyncio.to_thread(parent.poll, START_TIMEOUT_S):
                raise EOFError
            parent.recv()  # its "ready"
        except (EOFError, OSError) as e:
            self._stop_child()
            raise RuntimeError("the chat template renderer did not start") from e
        return parent

    def _stop_child(self) -> None:
        child, conn = self._child, self._conn
        self._child = self._conn = None
        if conn is not None:
            conn.close()
        if child is not None:
            child.kill()
            child.join()


def _serve(conn: Connection, tokenizer: "PreTrainedTokenizerBase", memory_bytes: int) -> None:
    """The child: load what rendering needs, cap the address space above
    what that took, then render requests until the pipe closes."""
    from rayvllm.frontend.processor import render_chat

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + memory_bytes, hard))
    conn.send("ready")
    while True:
        try:
            messages, options = conn.recv()
        except EOFError:
            return
        try:
            text = render_chat(tokenizer, messages, **options)
            if len(text) > MAX_RENDERED_CHARS:
                raise InvalidParameterError("chat_template", f"rendered over {MAX_RENDERED_CHARS} characters")
            conn.send(("ok", "", text))
        except InvalidParameterError as e:
            conn.send(("error", e.param, str(e).removeprefix(f"{e.param}: ")))
        except MemoryError:
            conn.send(("error", "chat_template", "rendering exceeded the memory allowed to a chat template"))


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    return pages * resource.getpagesize()
