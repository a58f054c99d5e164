"""Ownership of engine output streams, and server-sent event framing.

An engine stream aborts its request when it is closed before the end, so
whoever holds one must close it on every path: response complete, error,
cancellation, client gone. `EngineStreams` does that for the streams of one
API request; `EventStream` carries the duty on to the HTTP layer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel

from rayvllm.entrypoints.openai.protocol import error_body
from rayvllm.entrypoints.openai.stream_resume import StreamResume
from rayvllm.messages.outputs import RequestOutput

__all__ = ["SSE_DONE", "EngineStreams", "EventStream", "OutputStream", "sse", "sse_error"]

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel, include_usage: bool) -> str:
    """One `data: {json}` event. OpenAI sends `"usage": null` on every chunk
    but the last only when the client asked for usage; else the key is absent."""
    payload = chunk.model_dump_json(exclude=None if include_usage else {"usage"})
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    """The in-band error event of a stream whose 200 status is already sent."""
    return f"data: {json.dumps(error_body(exc)[1])}\n\n"


class OutputStream(Protocol):
    """An admitted request's outputs (`AsyncLLM.add_request`); closing it
    before its last output aborts the request."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


async def _aclose(stream: OutputStream) -> None:
    try:
        await stream.aclose()
    except Exception:  # one failing close must not keep the others open
        logger.exception("closing an engine stream failed")


async def _cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class EngineStreams:
    """The engine streams of one API request, one per prompt, each admitted
    already (errors in the input were raised then, before any token).

    Invariant: every stream gets closed: when `outputs()` ends however it
    ends, or on `aclose()`. Closing is idempotent.
    """

    def __init__(self, streams: list[OutputStream]) -> None:
        self._streams = streams

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Every output as (prompt index, output), in arrival order across
        prompts. Closes all streams at the end."""
        merged = self._merged(list(range(len(self._streams)))) if len(self._streams) > 1 else None
        try:
            if merged is None:  # the common single-prompt case needs no task hop
                async for out in self._streams[0]:
                    yield 0, out
            else:
                async for item in merged:
                    yield item
        finally:
            if merged is not None:
                await merged.aclose()  # stops its pumps before their streams close
            await self.aclose()

    async def _merged(self, indices: list[int]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for out in self._streams[index]:
                    queue.put_nowait((index, out))
            except Exception as e:  # handed to the consumer, which raises it
                queue.put_nowait((index, e))
            else:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i)) for i in indices]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            await _cancel_all(tasks)

    async def aclose(self) -> None:
        for stream in self._streams:
            await _aclose(stream)


class EventStream(AsyncIterator[str]):
    """Server-sent events of one streaming response, ending with `data: [DONE]`.

    The HTTP layer must `aclose()` it when it stops early, even if it never
    started iterating: its requests were admitted already, and closing the
    engine streams is what aborts them. `resume` is set when the stream may
    move to another replica mid-way (its events are then `ProgressEvent`s
    up to the usage and [DONE]): where it starts.
    """

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        on_close: Callable[[], Awaitable[None]],
        resume: StreamResume | None = None,
    ) -> None:
        self._events = events
        self._on_close = on_close
        self.resume = resume

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> str:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            await self._on_close()
