"""Tool-call parsers by vLLM's `tool_call_parser` names."""

from __future__ import annotations

from rayvllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from rayvllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from rayvllm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "ToolParser", "get_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; expected one of {', '.join(TOOL_PARSERS)}") from None
