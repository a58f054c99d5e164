"""POST /v1/responses (OpenAI's Responses API, stateless) over the chat
path: the conversation is rendered with the chat template and generated as
a chat completion is, then shaped as a Response object or as the Responses
stream events (`event: <type>` + `data: <json>`, numbered by
`sequence_number`, no `[DONE]`), in OpenAI's order:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done,
response.output_item.done, then response.completed, or
response.incomplete when `max_output_tokens` (or the context) cut the text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any

from pydantic import BaseModel

from rayvllm.entrypoints.openai.protocol import error_body
from rayvllm.entrypoints.openai.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from rayvllm.entrypoints.openai.serving import OpenAIServing, _named_for, _response_id, _Tally
from rayvllm.entrypoints.openai.streams import EngineStreams, EventStream

__all__ = ["OpenAIServingResponses"]

logger = logging.getLogger(__name__)


class _Events:
    """Formats the stream's events, numbering them from 0."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload: dict[str, Any] = {"type": kind, "sequence_number": self.sequence_number}
        for name, value in fields.items():
            payload[name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


class _Result:
    """What the engine said about the one generated message."""

    def __init__(self) -> None:
        self.tally = _Tally(1, 1, keep_outputs=True)
        self.cached_tokens = 0


class OpenAIServingResponses(OpenAIServing):
    async def create_response(self, req: ResponsesRequest, request_id: str) -> ResponsesResponse | EventStream:
        """A Response, or with `stream` an `EventStream` of its events.
        Errors (an unknown model, a bad field, a prompt too long) are
        raised before any stream exists, naming the request's field."""
        model = self._model_name(req.model)
        with _named_for(req):  # type: ignore[arg-type]
            params = req.to_sampling_params()
            prompt = self.engine.processor.render_chat(req.to_messages(), add_generation_prompt=True)
        streams = await self._start(req, [prompt], params, request_id)  # type: ignore[arg-type]
        response = partial(
            ResponsesResponse,
            id=_response_id("resp_", request_id),
            created_at=int(time.time()),
            model=model,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            metadata=req.metadata,
            temperature=req.temperature,
            top_p=req.top_p,
            user=req.user,
        )
        item_id = f"msg_{uuid.uuid4().hex}"
        result = _Result()
        if req.stream:
            return EventStream(self._events(streams, result, response, item_id), streams.aclose)
        await _absorb_all(streams, result)
        return _final(response, result, item_id)

    async def _events(
        self,
        streams: EngineStreams,
        result: _Result,
        response: Callable[..., ResponsesResponse],
        item_id: str,
    ) -> AsyncGenerator[str, None]:
        emit = _Events()
        yield emit("response.created", response=response(status="in_progress"))
        yield emit("response.in_progress", response=response(status="in_progress"))
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield emit("response.output_item.added", output_index=0, item=ResponseOutputMessage(id=item_id, status="in_progress"))
        yield emit("response.content_part.added", part=ResponseOutputText(text=""), **where)
        try:
            async with contextlib.aclosing(streams.outputs()) as outputs:
                async for prompt_index, out in outputs:
                    result.cached_tokens = out.num_cached_tokens or 0
                    for _, delta in result.tally.absorb(prompt_index, out):
                        if delta.text:
                            yield emit("response.output_text.delta", delta=delta.text, logprobs=[], **where)
        except Exception as e:
            # The 200 status line is long gone: the failure is an event.
            logger.warning("responses stream %s failed: %s", item_id, e)
            info = error_body(e)[1]["error"]
            yield emit("error", code=info["type"], message=info["message"], param=info["param"])
            return
        final = _final(response, result, item_id)
        message = final.output[0]
        part = message.content[0]
        yield emit("response.output_text.done", text=part.text, logprobs=[], **where)
        yield emit("response.content_part.done", part=part, **where)
        yield emit("response.output_item.done", output_index=0, item=message)
        yield emit("response.completed" if final.status == "completed" else "response.incomplete", response=final)


async def _absorb_all(streams: EngineStreams, result: _Result) -> None:
    async with contextlib.aclosing(streams.outputs()) as outputs:
        async for prompt_index, out in outputs:
            result.cached_tokens = out.num_cached_tokens or 0
            result.tally.absorb(prompt_index, out)


def _final(response: Callable[..., ResponsesResponse], result: _Result, item_id: str) -> ResponsesResponse:
    """The finished Response: "incomplete" when the length limit ended it."""
    choice = result.tally.choice(0)
    incomplete = choice.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    message = ResponseOutputMessage(
        id=item_id, status=status, content=[ResponseOutputText(text="".join(choice.text))]
    )
    usage = result.tally.usage()
    return response(
        status=status,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        output=[message],
        usage=ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        ),
    )
