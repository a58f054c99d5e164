"""Tool calling on /v1/chat/completions: OpenAI's request fields (`tools`,
`tool_choice`, `parallel_tool_calls`) and response parts (`tool_calls`,
whole and as stream deltas), plus the JSON schema that constrains a forced
call ("required" or a named function) so its arguments always parse.

`ToolRequestFields` is a base of `ChatCompletionRequest` (protocol.py).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.structured_outputs import StructuredOutputsParams

__all__ = [
    "ChatCompletionToolsParam",
    "DeltaFunctionCall",
    "DeltaToolCall",
    "FunctionCall",
    "FunctionDefinition",
    "NamedToolChoice",
    "ToolCall",
    "ToolRequestFields",
    "tool_call_id",
]

# A tool without `parameters` takes none (OpenAI's rule).
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: _NamedFunction


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    id: str = Field(default_factory=tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Model):
    """One tool call's part in a stream chunk; `id`, `type` and the name come
    with its first part only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


ToolChoiceMode = Literal["none", "auto", "required", "named"]


class ToolRequestFields(BaseModel):
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # OpenAI's deprecated forms: a 400 rather than silently ignored.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value: object) -> object:
        if value is not None:
            raise ValueError("is not supported; use tools and tool_choice")
        return value

    @property
    def tool_choice_mode(self) -> ToolChoiceMode:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    def check_tools(self) -> None:
        """The tools and the choice fit together; raises InvalidParameterError."""
        mode = self.tool_choice_mode
        if mode != "none" and not self.tools:
            raise InvalidParameterError("tool_choice", f"{self._choice_text()} needs tools")
        if mode == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)
            name = self.tool_choice.function.name
            if not any(t.function.name == name for t in self.tools or []):
                raise InvalidParameterError("tool_choice", f"names function {name!r}, which is not among the tools")

    def _choice_text(self) -> str:
        return "a named function" if self.tool_choice_mode == "named" else f'"{self.tool_choice_mode}"'

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (OpenAI's JSON shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tool_params(self) -> StructuredOutputsParams | None:
        """For "required": a JSON array of {"name", "parameters"} calls (one
        at most without parallel_tool_calls), each name with its own
        parameter schema; for a named function: its arguments object.
        None when the model chooses (or no tools). Compact JSON (no free
        whitespace): nothing reads a call's layout, and whitespace is where
        a weak model can spend every token it has."""
        mode = self.tool_choice_mode
        if mode == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)
            name = self.tool_choice.function.name
            tool = next(t for t in self.tools or [] if t.function.name == name)
            return StructuredOutputsParams(json=tool.function.parameters or _NO_PARAMETERS, disable_any_whitespace=True)
        if mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": t.function.parameters or _NO_PARAMETERS,
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools or []
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
