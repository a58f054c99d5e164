"""Tool calls of chat completions: how a request's `tool_choice` turns into
a constraint and a parser, and each choice's text into `tool_calls`.

- "none" (or no tools): plain text.
- "required" / a named function: the output is constrained to JSON (the
  call list / the function's arguments, `ToolRequestFields.forced_tool_params`),
  so it always parses; it is decoded here, not by a model-specific parser.
- "auto": the model decides; the server's `tool_call_parser` finds calls in
  its text. It needs `enable_auto_tool_choice` (vLLM's rule).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rayvllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from rayvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import StreamedToolCalls, call_from_json
from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    ToolChoiceMode,
    ToolRequestFields,
    tool_call_id,
)
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.structured_outputs import StructuredOutputsParams

__all__ = ["ChatTools", "ChoiceToolCalls"]

_DECODER = json.JSONDecoder()


class _ForcedCallList(ToolParser):
    """The JSON array "required" constrains the output to:
    `[{"name": ..., "parameters": {...}}, ...]`, calls streamed as each
    element completes."""

    def _split(self, text: str, final: bool) -> tuple[str, list[FunctionCall]]:
        body = text.lstrip()
        calls: list[FunctionCall] = []
        pos = 1
        while body.startswith("[") and pos < len(body):
            while pos < len(body) and body[pos] in " \t\n\r,":
                pos += 1
            try:
                obj, pos = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                break
            call = call_from_json(obj, ("parameters",))
            if call is None:
                break
            calls.append(call)
        if final and not calls:
            return text, []
        return "", calls


@dataclass
class ChoiceToolCalls:
    """One choice's tool-call state (streaming keeps it across chunks)."""

    named: str | None
    parser: ToolParser | None
    _started: bool = False

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice's text."""
        if self.named is not None:
            return None, [ToolCall(function=FunctionCall(name=self.named, arguments=text))]
        assert self.parser is not None
        found = self.parser.extract_tool_calls(text)
        return found.content, found.tool_calls

    def stream(self, delta_text: str, final: bool) -> StreamedToolCalls:
        if self.named is None:
            assert self.parser is not None
            return self.parser.extract_tool_calls_streaming(delta_text, final)
        # A named function's output is its arguments: stream them as they come.
        if not delta_text and self._started:
            return StreamedToolCalls()
        first = not self._started
        self._started = True
        return StreamedToolCalls(
            tool_calls=[
                DeltaToolCall(
                    index=0,
                    id=tool_call_id() if first else None,
                    type="function" if first else None,
                    function=DeltaFunctionCall(name=self.named if first else None, arguments=delta_text),
                )
            ]
        )


@dataclass
class ChatTools:
    """What a chat request's tools mean for its generation."""

    mode: ToolChoiceMode
    constraint: StructuredOutputsParams | None
    named: str | None
    parser_class: type[ToolParser] | None

    @classmethod
    def from_request(
        cls, req: ToolRequestFields, enable_auto_tool_choice: bool, tool_call_parser: str | None
    ) -> "ChatTools | None":
        """None when the output is plain text; raises InvalidParameterError
        for tools and choices that do not fit (or a server without auto)."""
        req.check_tools()
        mode = req.tool_choice_mode
        if mode == "none":
            return None
        if mode == "auto":
            if not enable_auto_tool_choice or tool_call_parser is None:
                raise InvalidParameterError(
                    "tool_choice",
                    '"auto" needs the server options enable_auto_tool_choice and tool_call_parser; '
                    'send "none", "required" or a named function',
                )
            return cls(mode, None, None, get_tool_parser(tool_call_parser))
        named = req.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
        parser = None if mode == "named" else _ForcedCallList
        return cls(mode, req.forced_tool_params(), named, parser)

    def for_choice(self) -> ChoiceToolCalls:
        return ChoiceToolCalls(self.named, self.parser_class() if self.parser_class is not None else None)

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" for an output that ended by calling tools."""
        return "tool_calls" if called and reason == "stop" else reason
