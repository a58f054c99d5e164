"""An HTTP answer in parts, as a server replica hands it to the router
ingress in front of it (entrypoints/openai/router_ingress.py) over a Serve
handle stream: a `ResponseHead`, then, for a stream, its chunks (a
resumable stream's as `ForwardedChunk`s, which say how far it has come).
Ray-free."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute

from rayvllm.entrypoints.openai.http_route import (
    FORWARDED_ATTR, PLANE_ATTR, PUBLIC_ATTR, READS_BODY_ATTR, REPLICA_WIDE_ATTR,
)
from rayvllm.entrypoints.openai.server_args import Plane
from rayvllm.entrypoints.openai.stream_resume import ProgressEvent, StreamResume
from rayvllm.entrypoints.openai.streams import EventStream

__all__ = ["ForwardedChunk", "ResponseHead", "RouteSpec", "StreamPacer", "forwarded_routes", "response_parts"]

Forwarded = Callable[..., Awaitable[Response]]


@dataclass(frozen=True)
class ResponseHead:
    """Status and headers; `body` is the whole body, or None when the
    chunks of a stream follow. `resume`: set for a stream that may move to
    another replica, where it starts (`EventStream.resume`)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes | None
    resume: StreamResume | None = None


@dataclass(frozen=True)
class ForwardedChunk:
    """Events of a resumable stream, joined (`data`), with what they carry:
    `StreamResume.advance`'s arguments once they are sent."""

    data: str
    token_ids: tuple[int, ...]
    text_chars: int
    num_cached_tokens: int
    finished: bool


@dataclass(frozen=True)
class RouteSpec:
    """One route of the server: `forwarded(owner, data, **route_kwargs)`
    answers it for a body read elsewhere; a `public` route takes no key;
    `reads_body`: whether it has a body to read; a `replica_wide` one goes
    to every replica; `plane` says which keys it takes (`RouteAccess.keys`)."""

    forwarded: Forwarded
    public: bool
    reads_body: bool
    replica_wide: bool = False
    plane: Plane = Plane.API


@dataclass
class StreamPacer:
    """How long a server's forwarded streams gather chunks into one message
    after their first (which goes at once). Each message costs this server
    and the router ingress CPU that the forward needs (docs/BENCHMARKS.md,
    the router ingress's hop), so the more streams are open, the longer
    each gathers: about `messages_per_s` messages a second across them, each
    stream's window within [`min_interval_s`, `max_interval_s`] (a few
    engine steps at most, so tokens still arrive in a steady trickle).
    Invariant: `open_streams` counts the streams between their head and
    their end."""

    min_interval_s: float = 0.02
    max_interval_s: float = 0.25
    messages_per_s: float = 400.0
    open_streams: int = 0

    def interval_s(self) -> float:
        return min(self.max_interval_s, max(self.min_interval_s, self.open_streams / self.messages_per_s))

    @contextlib.contextmanager
    def pacing(self) -> Iterator[None]:
        self.open_streams += 1
        try:
            yield
        finally:
            self.open_streams -= 1


def forwarded_routes(app: FastAPI, owner: type) -> dict[tuple[str, str], RouteSpec]:
    """(method, path) -> the route, for every `openai_route` of `owner` that `app` serves."""
    table: dict[tuple[str, str], RouteSpec] = {}
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        handler = getattr(owner, route.name, None)
        forwarded = getattr(handler, FORWARDED_ATTR, None)
        if forwarded is None:
            continue
        spec = RouteSpec(
            forwarded, bool(getattr(handler, PUBLIC_ATTR, False)), bool(getattr(handler, READS_BODY_ATTR, False)),
            bool(getattr(handler, REPLICA_WIDE_ATTR, False)), getattr(handler, PLANE_ATTR, Plane.API),
        )
        for method in route.methods:
            table[(method, route.path)] = spec
    return table


async def response_parts(
    response: Response, pacer: StreamPacer
) -> AsyncIterator[ResponseHead | ForwardedChunk | str | bytes]:
    """`response` as a head and, for a stream, its chunks: the first as soon
    as it is made, then what accumulates over each of `pacer`'s windows,
    joined. Closing this closes the stream's iterator (which ends the
    engine's requests)."""
    # The ingress's own response sets the length again (a stream has none).
    headers = [(k, v) for k, v in response.headers.items() if k != "content-length"]
    if not isinstance(response, StreamingResponse):
        yield ResponseHead(response.status_code, headers, bytes(response.body))
        return
    chunks = response.body_iterator
    # Entered before the head goes out: a stream closed right after its
    # head still ends its requests.
    closing = contextlib.aclosing(chunks) if hasattr(chunks, "aclose") else contextlib.nullcontext(chunks)
    resume = chunks.resume if isinstance(chunks, EventStream) else None
    async with closing:  # type: ignore[attr-defined]
        yield ResponseHead(response.status_code, headers, None, resume)
        # Closed before the stream is: its reader task must stop reading first.
        with pacer.pacing():
            async with contextlib.aclosing(_batched(chunks, pacer)) as batches:
                async for batch in batches:
                    yield batch


async def _batched(
    chunks: AsyncIterator[str | bytes], pacer: StreamPacer
) -> AsyncIterator[ForwardedChunk | str | bytes]:
    """The first chunks at once, then the chunks of each of `pacer`'s
    windows joined into one; the last window's as soon as the stream ends,
    then the stream's error if it failed. One task reads the whole stream:
    a task and a wait per chunk took the replica CPU that the forward
    needs (docs/BENCHMARKS_HISTORY.md, sixteenth session)."""
    pending: list[Any] = []
    arrived = asyncio.Event()

    async def read() -> None:
        try:
            async for chunk in chunks:
                pending.append(chunk)
                arrived.set()
        finally:
            arrived.set()

    reader = asyncio.ensure_future(read())
    try:
        first = True
        while True:
            await arrived.wait()
            if not first and not reader.done():
                await asyncio.wait({reader}, timeout=pacer.interval_s())  # the window gathers
            first = False
            arrived.clear()
            if pending:
                batch = pending[:]
                pending.clear()
                yield _joined(batch)
            if reader.done() and not pending:
                reader.result()  # the stream's error, if it failed
                return
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


def _joined(chunks: list[Any]) -> ForwardedChunk | str | bytes:
    """One message of `chunks`; a `ForwardedChunk` when any says how far its stream came."""
    data = (b"" if isinstance(chunks[0], bytes) else "").join(chunks)
    tagged = [c for c in chunks if isinstance(c, ProgressEvent)]
    if not tagged:
        return data
    token_ids = tuple(t for c in tagged for t in c.token_ids)
    last = tagged[-1]
    return ForwardedChunk(str(data), token_ids, last.text_chars, last.num_cached_tokens, last.finished)
