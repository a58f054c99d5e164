"""POST /v1/responses (OpenAI's Responses API, stateless) over the chat
path: the conversation (and its function tools) is rendered with the chat
template and generated as a chat completion is, then shaped as a Response
object or as the Responses stream events (`event: <type>` + `data: <json>`,
numbered by `sequence_number`, no `[DONE]`), in OpenAI's order:
response.created, response.in_progress, then per output item
response.output_item.added, for a message response.content_part.added,
response.output_text.delta..., response.output_text.done,
response.content_part.done, for a function call
response.function_call_arguments.delta..., .done, and
response.output_item.done; then response.completed, or
response.incomplete when `max_output_tokens` (or the context) cut the
output. Without tools the one message item opens at once; with tools an
item opens when its first text or call arrives (the model may answer with
calls only), and a call closes the message before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from functools import partial
from typing import Any

from pydantic import BaseModel

from rayvllm.entrypoints.openai.chat_tools import ChatTools, ChoiceToolCalls
from rayvllm.entrypoints.openai.protocol import error_body
from rayvllm.entrypoints.openai.responses_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from rayvllm.entrypoints.openai.serving import OpenAIServing, _named_for, _response_id, _Tally
from rayvllm.entrypoints.openai.streams import EngineStreams, EventStream
from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import DeltaToolCall

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
    """What the engine said about the one generated choice."""

    def __init__(self) -> None:
        self.tally = _Tally(1, 1, keep_outputs=True)
        self.cached_tokens = 0

    def status(self) -> str:
        """"incomplete" when the length limit ended the output."""
        return "incomplete" if self.tally.choice(0).finish_reason == "length" else "completed"


_OutputItem = ResponseOutputMessage | ResponseFunctionToolCall


def _message(text: str, status: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(id=f"msg_{uuid.uuid4().hex}", status=status, content=[ResponseOutputText(text=text)])


def _function_call(name: str, arguments: str, status: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(id=f"fc_{uuid.uuid4().hex}", call_id=f"call_{uuid.uuid4().hex}", name=name,
                                    arguments=arguments, status=status)


class _StreamedItems:
    """The output items of a streamed response, each event of their
    lifecycle formatted by `emit`; `items` is the output in output_index
    order. At most one message is open; it closes when a call begins."""

    def __init__(self, emit: _Events) -> None:
        self.emit = emit
        self.items: list[_OutputItem] = []
        self._message: tuple[int, list[str]] | None = None  # output index, texts so far
        self._calls: dict[int, int] = {}  # the parser's call index -> output index

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index].id, "output_index": index, "content_index": 0}

    def open_message(self) -> Iterator[str]:
        index = len(self.items)
        self.items.append(ResponseOutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress"))
        self._message = (index, [])
        yield self.emit("response.output_item.added", output_index=index, item=self.items[index])
        yield self.emit("response.content_part.added", part=ResponseOutputText(text=""), **self._where(index))

    def text(self, delta: str) -> Iterator[str]:
        if self._message is None:
            yield from self.open_message()
        assert self._message is not None
        index, texts = self._message
        texts.append(delta)
        yield self.emit("response.output_text.delta", delta=delta, logprobs=[], **self._where(index))

    def call(self, delta: DeltaToolCall) -> Iterator[str]:
        yield from self._close_message("completed")
        index = self._calls.get(delta.index)
        function = delta.function
        if index is None:
            index = self._calls[delta.index] = len(self.items)
            # A call's first delta carries its name (parsers emit whole calls; a named function, its name first).
            name = function.name if function is not None else None
            self.items.append(_function_call(name or "", "", "in_progress"))
            yield self.emit("response.output_item.added", output_index=index, item=self.items[index])
        if function is not None and function.arguments:
            item = self.items[index]
            assert isinstance(item, ResponseFunctionToolCall)
            item.arguments += function.arguments
            yield self.emit("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                            delta=function.arguments)

    def close(self, status: str) -> Iterator[str]:
        yield from self._close_message(status)
        for index in sorted(self._calls.values()):
            item = self.items[index]
            assert isinstance(item, ResponseFunctionToolCall)
            item.status = status  # type: ignore[assignment]
            yield self.emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                            name=item.name, arguments=item.arguments)
            yield self.emit("response.output_item.done", output_index=index, item=item)
        self._calls.clear()

    def _close_message(self, status: str) -> Iterator[str]:
        if self._message is None:
            return
        index, texts = self._message
        self._message = None
        part = ResponseOutputText(text="".join(texts))
        message = self.items[index] = ResponseOutputMessage(id=self.items[index].id, status=status, content=[part])
        yield self.emit("response.output_text.done", text=part.text, logprobs=[], **self._where(index))
        yield self.emit("response.content_part.done", part=part, **self._where(index))
        yield self.emit("response.output_item.done", output_index=index, item=message)


class OpenAIServingResponses(OpenAIServing):
    async def create_response(self, req: ResponsesRequest, request_id: str) -> ResponsesResponse | EventStream:
        """A Response, or with `stream` an `EventStream` of its events.
        Errors (an unknown model, a bad field, a prompt too long) are
        raised before any stream exists, naming the request's field."""
        model = self._model_name(req.model)
        with _named_for(req):  # type: ignore[arg-type]
            tool_fields = req.tool_fields()
            tools = ChatTools.from_request(tool_fields, self.enable_auto_tool_choice, self.tool_call_parser)
            params = self._with_tool_constraint(req.to_sampling_params(), tools)
            prompt = self.engine.render_chat(
                req.to_messages(), add_generation_prompt=True, tools=tool_fields.template_tools()
            )
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
            tools=req.tools or [],
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            parallel_tool_calls=req.parallel_tool_calls is not False,
            **({"text": req.text} if req.text else {}),
        )
        result = _Result()
        if req.stream:
            return EventStream(self._events(streams, result, response, tools), streams.aclose)
        await _absorb_all(streams, result)
        status = result.status()
        text = "".join(result.tally.choice(0).text)
        if tools is None:
            return _final(response, result, [_message(text, status)])
        content, calls = tools.for_choice().whole(text)
        items: list[_OutputItem] = [_message(content, status)] if content else []
        items += [_function_call(call.function.name, call.function.arguments, status) for call in calls]
        return _final(response, result, items)

    async def _events(
        self,
        streams: EngineStreams,
        result: _Result,
        response: Callable[..., ResponsesResponse],
        tools: ChatTools | None,
    ) -> AsyncGenerator[str, None]:
        emit = _Events()
        yield emit("response.created", response=response(status="in_progress"))
        yield emit("response.in_progress", response=response(status="in_progress"))
        items = _StreamedItems(emit)
        state: ChoiceToolCalls | None = None
        if tools is None:
            for event in items.open_message():
                yield event
        else:
            state = tools.for_choice()
        try:
            async with contextlib.aclosing(streams.outputs()) as outputs:
                async for prompt_index, out in outputs:
                    result.cached_tokens = out.num_cached_tokens or 0
                    for _, delta in result.tally.absorb(prompt_index, out):
                        for event in _delta_events(items, state, delta.text, delta.finish_reason is not None):
                            yield event
        except Exception as e:
            # The 200 status line is long gone: the failure is an event.
            logger.warning("responses stream %s failed: %s", response.keywords["id"], e)
            info = error_body(e)[1]["error"]
            yield emit("error", code=info["type"], message=info["message"], param=info["param"])
            return
        status = result.status()
        for event in items.close(status):
            yield event
        final = _final(response, result, items.items)
        yield emit("response.completed" if status == "completed" else "response.incomplete", response=final)


def _delta_events(items: _StreamedItems, state: ChoiceToolCalls | None, text: str, final: bool) -> Iterator[str]:
    """A piece of generated text as events: text deltas, or with tools what
    the choice's tool-call state makes of it (content and calls)."""
    if state is None:
        if text:
            yield from items.text(text)
        return
    part = state.stream(text, final)
    if part.content:
        yield from items.text(part.content)
    for call in part.tool_calls:
        yield from items.call(call)


async def _absorb_all(streams: EngineStreams, result: _Result) -> None:
    async with contextlib.aclosing(streams.outputs()) as outputs:
        async for prompt_index, out in outputs:
            result.cached_tokens = out.num_cached_tokens or 0
            result.tally.absorb(prompt_index, out)


def _final(response: Callable[..., ResponsesResponse], result: _Result, items: list[_OutputItem]) -> ResponsesResponse:
    """The finished Response with `items` as its output."""
    status = result.status()
    usage = result.tally.usage()
    return response(
        status=status,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        output=items,
        usage=ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        ),
    )
