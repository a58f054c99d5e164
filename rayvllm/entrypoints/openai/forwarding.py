"""An HTTP answer in parts, as a server replica hands it to the router
ingress in front of it (entrypoints/openai/router_ingress.py) over a Serve
handle stream: a `ResponseHead`, then, for a stream, its chunks (a
resumable stream's as `ForwardedChunk`s, which say how far it has come).
Ray-free."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute

from rayvllm.entrypoints.openai.http_route import FORWARDED_ATTR, PUBLIC_ATTR, READS_BODY_ATTR, REPLICA_WIDE_ATTR
from rayvllm.entrypoints.openai.stream_resume import ProgressEvent, StreamResume
from rayvllm.entrypoints.openai.streams import EventStream

__all__ = ["ForwardedChunk", "ResponseHead", "RouteSpec", "forwarded_routes", "response_parts"]

# How long a forwarded stream gathers chunks into one message after its
# first (which goes at once): a few engine steps' worth at most, so tokens
# still arrive in a steady trickle.
STREAM_BATCH_INTERVAL_S = 0.02

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
    answers it for a body read elsewhere; a `public` route takes no API
    key; `reads_body`: whether it has a body to read; a `replica_wide` one
    goes to every replica."""

    forwarded: Forwarded
    public: bool
    reads_body: bool
    replica_wide: bool = False


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
            bool(getattr(handler, REPLICA_WIDE_ATTR, False)),
        )
        for method in route.methods:
            table[(method, route.path)] = spec
    return table


async def response_parts(
    response: Response, batch_interval_s: float = STREAM_BATCH_INTERVAL_S
) -> AsyncIterator[ResponseHead | ForwardedChunk | str | bytes]:
    """`response` as a head and, for a stream, its chunks: the first as soon
    as it is made, then what accumulates over each `batch_interval_s`,
    joined (a handle-stream message per SSE event costs both processes CPU
    that the forward needs). Closing this closes the stream's iterator
    (which ends the engine's requests)."""
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
        async for batch in _batched(chunks, batch_interval_s):
            yield batch


async def _batched(
    chunks: AsyncIterator[str | bytes], interval_s: float
) -> AsyncIterator[ForwardedChunk | str | bytes]:
    """The first chunk at once, then the chunks of each `interval_s`
    window joined into one; the last window's as soon as the stream ends."""
    loop = asyncio.get_running_loop()
    pending: list[Any] = []
    deadline = 0.0
    step = asyncio.ensure_future(anext(chunks))
    try:
        first = True
        while True:
            timeout = None if not pending else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({step}, timeout=timeout)
            if not done:  # the window closed
                yield _joined(pending)
                pending = []
                continue
            try:
                chunk = step.result()
            except StopAsyncIteration:
                break
            step = asyncio.ensure_future(anext(chunks))
            if first:
                first = False
                yield _joined([chunk])
                continue
            if not pending:
                deadline = loop.time() + interval_s
            pending.append(chunk)
        if pending:
            yield _joined(pending)
    finally:
        if not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await step


def _joined(chunks: list[Any]) -> ForwardedChunk | str | bytes:
    """One message of `chunks`; a `ForwardedChunk` when any says how far its stream came."""
    data = (b"" if isinstance(chunks[0], bytes) else "").join(chunks)
    tagged = [c for c in chunks if isinstance(c, ProgressEvent)]
    if not tagged:
        return data
    token_ids = tuple(t for c in tagged for t in c.token_ids)
    last = tagged[-1]
    return ForwardedChunk(str(data), token_ids, last.text_chars, last.num_cached_tokens, last.finished)
