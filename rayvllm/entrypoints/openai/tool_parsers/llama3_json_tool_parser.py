"""Llama 3.x JSON tool calls: the output is one or more
`{"name": ..., "parameters": {...}}` objects (separated by `;`), possibly
after `<|python_tag|>`; an output that starts otherwise is content."""

from __future__ import annotations

import json

from rayvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, call_from_json
from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import FunctionCall

BOT = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    def _split(self, text: str, final: bool) -> tuple[str, list[FunctionCall]]:
        body = text.lstrip()
        if body.startswith(BOT):
            body = body[len(BOT) :].lstrip()
        elif not final and (not body or BOT.startswith(body)):
            return "", []  # not yet known whether this is a call
        if not body:
            return ("" if text.lstrip().startswith(BOT) else text), []
        if body[0] != "{":
            return text, []
        calls: list[FunctionCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except json.JSONDecodeError:
                break  # the next object is not complete yet
            call = call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        if final and not calls:
            return text, []  # no call after all: all of it is content
        return "", calls
