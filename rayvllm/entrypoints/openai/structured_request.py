"""The request fields that ask for structured outputs, in every form
clients send them: OpenAI's `response_format`, vLLM's `structured_outputs`
object and its older `guided_*` fields. `StructuredOutputRequestFields` is
a base of both generation requests (protocol.py); it turns whichever form
was sent into one `StructuredOutputsParams` and names that form in errors.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.structured_outputs import StructuredOutputsParams

__all__ = ["JsonSchemaResponseFormat", "ResponseFormat", "StructuredOutputRequestFields", "StructuredOutputsRequest"]


class JsonSchemaResponseFormat(BaseModel):
    """OpenAI's `response_format.json_schema`; `strict` is accepted and
    implied (the schema is always enforced)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request object. Unknown keys are a 400:
    a misspelt constraint silently ignored would be an unconstrained output."""

    model_config = ConfigDict(extra="forbid")

    json_schema: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # vLLM's: whether it may fall back to another grammar backend. There is
    # one backend here, so never; accepted for clients that send it.
    disable_fallback: bool = False


class StructuredOutputRequestFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _forms(self) -> dict[str, dict[str, Any]]:
        """The forms sent, by request field, as StructuredOutputsParams kwargs."""
        forms: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            forms["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise InvalidParameterError("response_format.json_schema", "a json_schema with a schema is required")
            forms["response_format"] = {"json": fmt.json_schema.json_schema}
        so = self.structured_outputs
        if so is not None:
            forms["structured_outputs"] = {
                "json": so.json_schema, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                "json_object": so.json_object, "disable_any_whitespace": so.disable_any_whitespace,
            }
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                forms[f"guided_{kind}"] = {kind: value}
        return forms

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one grammar the request asks for (None: unconstrained)."""
        forms = self._forms()
        if len(forms) > 1:
            raise InvalidParameterError(sorted(forms)[1], f"only one of {', '.join(sorted(forms))} may be set")
        if not forms:
            return None
        return StructuredOutputsParams(**next(iter(forms.values())))

    def structured_outputs_field(self, name: str) -> str:
        """The request field an error about `name` ("structured_outputs.json")
        is about: the form the client used."""
        forms = list(self._forms())
        if not forms or forms[0] == "structured_outputs":
            return name
        return forms[0]
