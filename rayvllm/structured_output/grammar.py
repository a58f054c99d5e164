"""The seam to the grammar library (xgrammar, as vLLM and SGLang use):
parse a request's grammar at admission, compile it for a tokenizer on the
worker that samples it.

xgrammar is imported on first use only, so an engine that never sees a
structured request never loads it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# Compiled grammars a worker keeps (most recently used first out last):
# requests of one application usually share a handful of schemas.
COMPILED_CACHE_SIZE = 256
_ANY_OBJECT = '{"type": "object"}'
# xgrammar's parse and compile errors (its own derive from RuntimeError).
_GRAMMAR_ERRORS = (RuntimeError, ValueError, TypeError)


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose language is exactly `choices`. JSON string literals
    are valid EBNF literals in xgrammar's dialect (same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(params: StructuredOutputsParams) -> str:
    try:
        schema = json.loads(params.spec)
    except json.JSONDecodeError as e:
        raise InvalidParameterError(params.field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidParameterError(params.field, "must be a JSON schema object")
    return params.spec


def validate(params: StructuredOutputsParams) -> None:
    """Parse the grammar (no tokenizer needed, well under a millisecond for
    a typical schema): an invalid or unsupported schema, regex or EBNF
    raises InvalidParameterError naming the field, at admission, so no
    worker ever compiles a grammar that cannot be built. Grammars that
    parsed are remembered (by key), as an application repeats its few."""
    if params.key in _VALID:
        _VALID.move_to_end(params.key)
        return
    _parse(params)
    _VALID[params.key] = None
    if len(_VALID) > COMPILED_CACHE_SIZE:
        _VALID.popitem(last=False)


_VALID: OrderedDict[tuple[str, str, bool], None] = OrderedDict()


def _parse(params: StructuredOutputsParams) -> None:
    xgr = _xgr()
    try:
        if params.kind == "json":
            xgr.Grammar.from_json_schema(
                _schema_text(params), any_whitespace=not params.disable_any_whitespace
            )
        elif params.kind == "regex":
            xgr.Grammar.from_regex(params.spec)
        elif params.kind == "grammar":
            xgr.Grammar.from_ebnf(params.spec)
        elif params.kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(params.spec)))
    except _GRAMMAR_ERRORS as e:
        raise InvalidParameterError(params.field, f"cannot be compiled to a grammar: {e}") from None


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary, keeping the last
    `COMPILED_CACHE_SIZE` by `StructuredOutputsParams.key`. Thread-safe for
    one caller thread at a time (the worker's compile thread)."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", vocab_size: int) -> None:
        """`vocab_size`: the model's logits width, which may exceed the
        tokenizer's vocabulary (the padding ids are never allowed)."""
        xgr = _xgr()
        self.vocab_size = vocab_size
        # Stop tokens are given per matcher (the request's own), not here.
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str, bool], "xgrammar.CompiledGrammar"] = OrderedDict()
        self.num_compiled = 0

    def compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        key = params.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiled = self._compile(params)
        self.num_compiled += 1
        self._cache[key] = compiled
        if len(self._cache) > COMPILED_CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        c = self._compiler
        if params.kind == "json":
            return c.compile_json_schema(params.spec, any_whitespace=not params.disable_any_whitespace)
        if params.kind == "json_object":
            # Any object (OpenAI's json_object), not any JSON value; strict
            # mode would bar every property an empty schema does not list.
            return c.compile_json_schema(
                _ANY_OBJECT, any_whitespace=not params.disable_any_whitespace, strict_mode=False
            )
        if params.kind == "regex":
            return c.compile_regex(params.spec)
        if params.kind == "choice":
            return c.compile_grammar(choice_ebnf(json.loads(params.spec)))
        return c.compile_grammar(params.spec)

    def matcher(self, params: StructuredOutputsParams, stop_token_ids: list[int]) -> "xgrammar.GrammarMatcher":
        """A fresh matcher for `params` that ends on `stop_token_ids`."""
        return _xgr().GrammarMatcher(self.compile(params), override_stop_tokens=stop_token_ids)
