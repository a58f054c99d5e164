"""POST /v1/responses: request, response and stream-event models, in the
shapes of the official `openai` package (`openai.types.responses`).

The server is stateless: nothing is stored, so `previous_response_id` (and
`background`) are refused with a 400 naming them, and `store` is ignored.
Input is text: a string, or items: messages whose content is a string or
`input_text` / `output_text` parts, and the function calls of earlier
turns with their outputs (`function_call`, `function_call_output`), which
reach the chat template as assistant tool calls and tool messages.
Function `tools` (the Responses shape: name and parameters at the top of
the tool) and `tool_choice` mean what they mean on chat completions
(chat_tools.py); `text.format` json_schema / json_object constrain the
output as `response_format` does there.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from rayvllm.entrypoints.openai.protocol import OpenAIBaseModel, with_param
from rayvllm.entrypoints.openai.structured_request import JsonSchemaResponseFormat
from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import (
    ChatCompletionToolsParam,
    FunctionDefinition,
    NamedToolChoice,
    ToolRequestFields,
)
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.structured_outputs import StructuredOutputsParams

__all__ = [
    "IncompleteDetails",
    "InputTokensDetails",
    "OutputTokensDetails",
    "ResponseFunctionToolCall",
    "ResponseInputItem",
    "ResponseInputPart",
    "ResponseOutputMessage",
    "ResponseOutputText",
    "ResponseUsage",
    "ResponsesRequest",
    "ResponsesResponse",
]

# Content part types whose text a text-only model can read.
_TEXT_PARTS = ("input_text", "output_text")


class ResponseInputPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ResponseInputItem(OpenAIBaseModel):
    """An input item: a message (OpenAI's `EasyInputMessage` and input
    message items), an earlier turn's `function_call` or its
    `function_call_output`; the type is checked in `to_messages`."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ResponseInputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class ResponsesRequest(OpenAIBaseModel):
    _PARAM_NAMES: ClassVar[dict[str, str]] = {
        "max_tokens": "max_output_tokens",
        "prompt": "input",
        "prompt_token_ids": "input",
        "messages": "input",
    }
    # The rendered chat template already holds the special tokens.
    add_special_tokens: ClassVar[bool] = False

    model: str | None = None
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("is not supported: this server is stateless and stores no responses; send the "
                             "whole conversation as input")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("is not supported: this server is stateless and stores no responses")
        return value

    @field_validator("text")
    @classmethod
    def _text_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        fmt = (value or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"format type {fmt.get('type')!r} is not supported; 'text', 'json_object' or "
                             "'json_schema'")
        return value

    def tool_fields(self) -> ToolRequestFields:
        """`tools` and `tool_choice` in the chat completions shape, so they
        mean what they mean there; only function tools exist here."""
        tools: list[ChatCompletionToolsParam] = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise InvalidParameterError(f"tools.{i}.type", f"tool type {tool.get('type')!r} is not supported "
                                            "(function tools only)")
            try:
                tools.append(ChatCompletionToolsParam(function=FunctionDefinition.model_validate(tool)))
            except ValueError as e:
                raise InvalidParameterError(f"tools.{i}", f"is not a function tool: {e}") from None
        choice: Any = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidParameterError("tool_choice", 'must be "none", "auto", "required" or '
                                            '{"type": "function", "name": ...}')
            choice = NamedToolChoice(function={"name": choice["name"]})
        elif choice not in (None, "none", "auto", "required"):
            raise InvalidParameterError("tool_choice", f'{choice!r} is not "none", "auto" or "required"')
        return ToolRequestFields(tools=tools or None, tool_choice=choice, parallel_tool_calls=self.parallel_tool_calls)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """`text.format` as a grammar: json_schema or json_object; None for text."""
        fmt = (self.text or {}).get("format")
        if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
            return None
        if fmt["type"] == "json_object":
            return StructuredOutputsParams(json_object=True)
        try:
            schema = JsonSchemaResponseFormat.model_validate(fmt).json_schema
        except ValueError as e:
            raise InvalidParameterError("text.format", f"is not a json_schema format: {e}") from None
        if schema is None:
            raise InvalidParameterError("text.format.schema", "a json_schema format needs a schema")
        return StructuredOutputsParams(json=schema)

    def translate_error(self, exc: InvalidParameterError) -> InvalidParameterError:
        if exc.param.startswith("structured_outputs"):
            return with_param(exc, "text.format")  # the grammar of text.format failed to build
        return with_param(exc, self._PARAM_NAMES.get(exc.param, exc.param))

    def to_sampling_params(self) -> SamplingParams:
        kwargs: dict[str, Any] = {"max_tokens": self.max_output_tokens}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        try:
            kwargs["structured_outputs"] = self.structured_outputs_params()
            return SamplingParams(**kwargs)
        except InvalidParameterError as e:
            raise self.translate_error(e) from e

    def to_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: `instructions` as a system
        message first, a string `input` as one user message; consecutive
        `function_call` items as one assistant message with their tool calls,
        each `function_call_output` as a tool message."""
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        if not self.input:
            raise InvalidParameterError("input", "must not be empty")
        for i, item in enumerate(self.input):
            if item.type == "message":
                if item.role is None:
                    raise InvalidParameterError(f"input.{i}.role", "a message needs a role")
                messages.append({"role": item.role, "content": _content_text(item.content, i)})
            elif item.type == "function_call":
                call = {"id": _required(item.call_id, i, "call_id"), "type": "function",
                        "function": {"name": _required(item.name, i, "name"),
                                     "arguments": _required(item.arguments, i, "arguments")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": _required(item.call_id, i, "call_id"),
                                 "content": _required(item.output, i, "output")})
            else:
                raise InvalidParameterError(f"input.{i}.type", f"item type {item.type!r} is not supported "
                                            "(message, function_call, function_call_output)")
        return messages


def _required(value: str | None, index: int, name: str) -> str:
    if value is None:
        raise InvalidParameterError(f"input.{index}.{name}", "is required for this item type")
    return value


def _content_text(content: str | list[ResponseInputPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidParameterError(
                f"input.{index}.content.{j}", f"content part of type {part.type!r} is not supported (text only)"
            )
        texts.append(part.text)
    return "\n".join(texts)


# ---- the Response object ---------------------------------------------------------------


class ResponseOutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseFunctionToolCall(OpenAIBaseModel):
    """A call of one of the request's function tools; `arguments` is JSON text."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(OpenAIBaseModel):
    """`status` "incomplete" (with `incomplete_details`) when
    `max_output_tokens` or the context length cut the output, as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    output: list[ResponseOutputMessage | ResponseFunctionToolCall] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
