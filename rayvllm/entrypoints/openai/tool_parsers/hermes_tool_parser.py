"""Hermes-style tool calls (Qwen 2.5/3, Hermes 2/3, the demo model's
template): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, content before the first block."""

from __future__ import annotations

import json
import re

from rayvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, call_from_json, partial_suffix
from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import FunctionCall

START, END = "<tool_call>", "</tool_call>"
_CLOSED = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


class Hermes2ProToolParser(ToolParser):
    def _split(self, text: str, final: bool) -> tuple[str, list[FunctionCall]]:
        start = text.find(START)
        if start < 0:
            return text[: len(text) - (0 if final else partial_suffix(text, START))], []
        bodies = [m.group(1) for m in _CLOSED.finditer(text, start)]
        if final:
            # A last block the output ended inside (cut at a stop token).
            tail = text.rfind(START)
            if text.find(END, tail) < 0:
                bodies.append(text[tail + len(START) :])
        calls = []
        for body in bodies:
            try:
                call = call_from_json(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if final and not calls:
            return text, []  # no call after all: all of it is content
        return text[:start], calls
