"""`StructuredOutputsParams`: what a request's output must match (vLLM's
names). Plain data, importable without the grammar library: the grammar is
parsed at admission (`structured_output.grammar.validate`) and compiled on
the worker that samples the request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rayvllm.messages.errors import InvalidParameterError

StructuredOutputKind = Literal["json", "regex", "choice", "grammar", "json_object"]
# The request fields a client may name: one of them, exactly.
_KINDS: tuple[StructuredOutputKind, ...] = ("json", "regex", "choice", "grammar", "json_object")
# Bounds on what one request may make a worker compile and hold.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or its JSON text),
    `regex`, `choice` (the output is one of these strings), `grammar` (EBNF,
    xgrammar's dialect, `root` the start rule) or `json_object=True` (any
    JSON object) is set. `disable_any_whitespace`: JSON without free
    whitespace between tokens (one compact form).

    Invariant after construction: `kind` names the one field set and `spec`
    holds it as text (a schema serialised in its own key order, which
    decides the order fields are generated in), so `(kind, spec,
    disable_any_whitespace)` identifies the grammar (`key`).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            what = f"got {', '.join(chosen)}" if chosen else "none was set"
            raise InvalidParameterError(
                "structured_outputs", f"set exactly one of json, regex, choice, grammar, json_object; {what}"
            )
        self._kind: StructuredOutputKind = chosen[0]
        self._spec = self._as_text(chosen[0])
        if len(self._spec) > MAX_SPEC_CHARS:
            raise InvalidParameterError(self.field, f"at most {MAX_SPEC_CHARS} characters, got {len(self._spec)}")

    def _as_text(self, kind: StructuredOutputKind) -> str:
        if kind == "json":
            value = self.json
            if isinstance(value, dict):
                return json.dumps(value, ensure_ascii=False)
            if not isinstance(value, str):
                raise InvalidParameterError(self.field_for(kind), "must be a JSON schema (an object or its JSON text)")
            return value
        if kind == "choice":
            choices = self.choice
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidParameterError(self.field_for(kind), "must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise InvalidParameterError(self.field_for(kind), f"at most {MAX_CHOICES} choices, got {len(choices)}")
            return json.dumps(choices, ensure_ascii=False)
        if kind == "json_object":
            if self.json_object is not True:
                raise InvalidParameterError(self.field_for(kind), "must be true or unset")
            return ""
        value = getattr(self, kind)
        if not isinstance(value, str) or not value:
            raise InvalidParameterError(self.field_for(kind), "must be a non-empty string")
        return value

    @staticmethod
    def field_for(kind: StructuredOutputKind) -> str:
        return f"structured_outputs.{kind}"

    @property
    def kind(self) -> StructuredOutputKind:
        return self._kind

    @property
    def spec(self) -> str:
        return self._spec

    @property
    def field(self) -> str:
        """The dotted request field errors about this grammar name."""
        return self.field_for(self._kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self._kind, self._spec, self.disable_any_whitespace)
