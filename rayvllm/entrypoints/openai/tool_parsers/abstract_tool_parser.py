"""The tool-call parser interface: text a model wrote in, tool calls out,
whole (`extract_tool_calls`) or as stream deltas
(`extract_tool_calls_streaming`).

A parser describes its format once, in `_split(text, final)`: the part of
`text` that is surely content, and the calls complete in it. Streaming
emits what `_split` of the text so far adds to what it emitted before, and
the whole-text answer is `_split(text, final=True)`: so the deltas of a
stream always add up to the whole answer, however the text was cut.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    tool_call_id,
)

__all__ = ["ExtractedToolCalls", "StreamedToolCalls", "ToolParser", "call_from_json", "partial_suffix"]


@dataclass
class ExtractedToolCalls:
    """`content` is the text that is not a call (None when empty)."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class StreamedToolCalls:
    """What one piece of streamed text adds: content and whole calls."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of `text` that begins `token` (and is not
    all of it): text that may yet turn out to be the token."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def call_from_json(obj: Any, arguments_keys: tuple[str, ...]) -> FunctionCall | None:
    """A call from a decoded `{"name": ..., <arguments key>: {...}}`, its
    arguments re-serialised as JSON text; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    return FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


class ToolParser(ABC):
    """Parses one choice's output. A streaming parser holds that choice's
    state: use one instance per choice."""

    def __init__(self) -> None:
        self._text = ""
        self._content_sent = 0
        self._calls_sent = 0

    @abstractmethod
    def _split(self, text: str, final: bool) -> tuple[str, list[FunctionCall]]:
        """(the content of `text` so far, which later text cannot change;
        the calls complete in it). With `final`, `text` is all there is."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        content, calls = self._split(text, True)
        if not calls:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [ToolCall(function=c) for c in calls], content or None)

    def extract_tool_calls_streaming(self, delta_text: str, final: bool = False) -> StreamedToolCalls:
        """What `delta_text` (the next piece of the output) adds; with
        `final`, also what was held back in case more text came."""
        self._text += delta_text
        content, calls = self._split(self._text, final)
        out = StreamedToolCalls(content=content[self._content_sent :])
        self._content_sent = max(self._content_sent, len(content))
        for call in calls[self._calls_sent :]:
            out.tool_calls.append(
                DeltaToolCall(
                    index=self._calls_sent, id=tool_call_id(), type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                )
            )
            self._calls_sent += 1
        return out
