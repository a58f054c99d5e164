"""The request front end (vLLM v1's Processor): prompt in, EngineCoreRequest out.

Everything a client can get wrong is caught here, before the engine core sees
the request, and reported as an `InvalidParameterError` naming the field
(the API server turns it into a 400). What leaves is fully tokenized, with
`max_tokens` concrete and the stop token ids resolved, so the core never
consults the tokenizer or the model config for a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NotRequired, Required, TypeAlias, TypedDict, cast

from rayvllm.config import ModelConfig
from rayvllm.config.lora import LoRAConfig
from rayvllm.lora.checker import LoRAChecker
from rayvllm.messages.errors import InvalidParameterError, PromptTooLongError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.sampling_params import SEED_MIN, SamplingParams
from rayvllm.utils.tokenizer import get_eos_token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "Processor",
    "PromptType",
    "TextPrompt",
    "TokensPrompt",
    "child_request_id",
    "fan_out",
    "render_chat",
]

DEFAULT_MAX_LOGPROBS = 20


class TextPrompt(TypedDict, total=False):
    """A prompt given as text; `cache_salt` isolates its prefix-cache entries."""

    prompt: Required[str]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict, total=False):
    """A pre-tokenized prompt; `prompt` is optional text echoed in outputs."""

    prompt_token_ids: Required[list[int]]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType: TypeAlias = str | TextPrompt | TokensPrompt

_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
# Arguments apply_chat_template takes from us; user kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template", "tools"}
)


def _check_template_flags(
    add_generation_prompt: bool, continue_final_message: bool, chat_template_kwargs: Mapping[str, Any] | None
) -> None:
    # A new assistant turn and an open last turn contradict each other.
    if add_generation_prompt and continue_final_message:
        raise InvalidParameterError("continue_final_message", "cannot be used together with add_generation_prompt=True")
    if chat_template_kwargs:
        clash = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs))
        if clash:
            raise InvalidParameterError("chat_template_kwargs", f"may not set {', '.join(clash)}; use the dedicated arguments")


def render_chat(
    tokenizer: "PreTrainedTokenizerBase",
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a conversation to prompt text with the chat template.

    Message content may be a string, None, or OpenAI-style parts; text
    parts are joined with newlines (the model is text-only).
    `chat_template` overrides the tokenizer's; `chat_template_kwargs`
    reach the template as extra variables (e.g. `enable_thinking`).
    The text already holds the template's special tokens (BOS
    included): tokenize it with add_special_tokens=False.
    """
    _check_template_flags(add_generation_prompt, continue_final_message, chat_template_kwargs)
    conversation = _normalize_messages(messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidParameterError("chat_template", "the model has no chat template; pass one explicitly")
    tool_list: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools is not None else None
    try:
        rendered = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template,
            tools=tool_list,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja2 errors, HF ValueErrors: all the client's input
        raise InvalidParameterError("messages", f"cannot apply the chat template: {e}") from e
    if not isinstance(rendered, str):
        raise InvalidParameterError("messages", "the chat template did not render to text")
    return rendered


def child_request_id(index: int, parent_id: str) -> str:
    """Engine-core id of sequence `index` of a request with `n > 1` (vLLM's format)."""
    return f"{index}_{parent_id}"


def fan_out(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """Split a request with `n > 1` into n engine-core requests with `n == 1`.

    Child i gets id `f"{i}_{request_id}"` and, when the parent is seeded, seed
    `seed + i` (wrapped into the signed 64-bit range): children sample differently, yet rerunning the same request
    reproduces every child, and child 0 matches the same request with n=1.
    Unseeded children share one params object (nothing in it differs).
    `parent_request_id` lets the scheduler hold siblings back until the first
    one has computed the prompt, so the others share its blocks.
    A request with n == 1 is returned as is, under its own id.
    """
    params = request.sampling_params
    if params.n == 1:
        return [request]
    shared: SamplingParams | None = None
    children: list[EngineCoreRequest] = []
    for index in range(params.n):
        if params.seed is None:
            if shared is None:
                shared = params.clone(n=1)
            child_params = shared
        else:
            child_params = params.clone(n=1, seed=(params.seed + index - SEED_MIN) % 2**64 + SEED_MIN)
        children.append(
            replace(
                request,
                request_id=child_request_id(index, request.request_id),
                sampling_params=child_params,
                parent_request_id=request.request_id,
            )
        )
    return children


class Processor:
    """Validates and tokenizes requests for one model.

    Invariants of every EngineCoreRequest it returns: 1 <= len(prompt) <
    max_model_len; all prompt ids in [0, vocab_size); `sampling_params` is a
    private copy with `max_tokens` concrete and `prompt_len + max_tokens <=
    max_model_len`; `all_stop_token_ids` = stop_token_ids plus the EOS ids
    (unless ignore_eos, which a grammar overrides); a structured request's
    grammar parses; `eos_token_id` is the primary EOS (or None). The
    caller's SamplingParams is never mutated.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: "PreTrainedTokenizerBase",
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        eos_token_ids: Sequence[int] | None = None,
        max_n: int | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        """`max_logprobs`: cap on logprobs/prompt_logprobs (-1: the vocab size).
        `eos_token_ids`: override of what `get_eos_token_ids` finds, primary first.
        `max_n`: cap on a request's `n` (the engines pass `max_num_seqs`:
        more sequences than one step can run only queue, and each costs a
        request in the engine); None for no cap.
        `lora_config`: LoRA enabled (None: a request's lora_request is a 400)."""
        self.model_config = model_config
        self.lora = LoRAChecker(lora_config, model_config.hf_config)
        self.max_n = max_n
        # No token of this vocabulary covers more characters than its longest
        # entry (byte-level entries have one character per byte), so a text
        # longer than this many characters cannot fit max_model_len tokens:
        # it is refused before the tokenizer walks megabytes of it.
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = model_config.max_model_len * max(longest, 1)
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else max_logprobs
        if self.max_logprobs < 0:
            raise InvalidParameterError("max_logprobs", f"must be >= 0 or -1, got {max_logprobs}")
        ids = list(eos_token_ids) if eos_token_ids is not None else get_eos_token_ids(tokenizer, model_config.model)
        self.eos_token_ids: list[int] = [i for i in ids if 0 <= i < self.vocab_size]
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None

    # ---- prompts ---------------------------------------------------------------

    @staticmethod
    def prompt_text(prompt: PromptType) -> str | None:
        """The text to echo in outputs for `prompt` (None for bare token ids)."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, Mapping):
            text = prompt.get("prompt")
            return text if isinstance(text, str) else None
        return None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; text that is not Unicode (JSON's "\\ud800":
        a lone surrogate, which the tokenizer refuses with a TypeError) is
        the prompt's fault."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidParameterError("prompt", f"is not valid Unicode text ({e.reason} at {e.start})") from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _prompt_ids(self, prompt: PromptType, add_special_tokens: bool) -> tuple[list[int], str | None]:
        """Token ids and cache salt of `prompt`, type-checked and non-empty."""
        cache_salt: str | None = None
        if isinstance(prompt, str):
            text: str | None = prompt
            ids: list[int] | None = None
        elif isinstance(prompt, Mapping):
            # Typed as the TypedDicts, but arriving from clients: check every key.
            fields = cast(Mapping[str, Any], prompt)
            unknown = sorted(str(k) for k in fields if k not in _PROMPT_KEYS)
            if unknown:
                raise InvalidParameterError("prompt", f"unknown keys {unknown}; expected prompt, prompt_token_ids, cache_salt")
            cache_salt = fields.get("cache_salt")
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise InvalidParameterError("cache_salt", "must be a string")
            if "prompt_token_ids" in fields:
                raw = fields["prompt_token_ids"]
                if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
                    raise InvalidParameterError("prompt_token_ids", "must be a list of integers")
                if any(not isinstance(t, int) or isinstance(t, bool) for t in raw):
                    raise InvalidParameterError("prompt_token_ids", "must be a list of integers")
                ids, text = list(raw), None
                if not ids:
                    raise InvalidParameterError("prompt_token_ids", "must not be empty")
            elif "prompt" in fields:
                text, ids = fields["prompt"], None
                if not isinstance(text, str):
                    raise InvalidParameterError("prompt", "must be a string")
            else:
                raise InvalidParameterError("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        else:
            raise InvalidParameterError(
                "prompt", f"must be a string, {{'prompt': str}} or {{'prompt_token_ids': [int]}}, got {type(prompt).__name__}"
            )
        if ids is None:
            assert text is not None
            if not text:
                raise InvalidParameterError("prompt", "must not be empty")
            if len(text) > self.max_prompt_chars:
                raise InvalidParameterError(
                    "prompt",
                    f"the prompt has {len(text)} characters, more than max_model_len={self.max_model_len} "
                    "tokens can hold",
                )
            ids = self.tokenize(text, add_special_tokens=add_special_tokens)
            if not ids:
                raise InvalidParameterError("prompt", "tokenizes to no tokens")
        return ids, cache_salt

    # ---- requests --------------------------------------------------------------

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> EngineCoreRequest:
        """Validate and tokenize one request (n > 1 stays one request; see `fan_out`).

        `params`: SamplingParams on a generating model, PoolingParams on a
        pooling one (the other is a 400 naming `model`). A pooled prompt
        may fill max_model_len, as nothing is generated after it.
        `add_special_tokens` applies to text prompts only (False for text
        that a chat template already rendered, BOS included).
        Raises InvalidParameterError / PromptTooLongError.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidParameterError("request_id", "must be a non-empty string")
        if not isinstance(params, (SamplingParams, PoolingParams)):
            raise InvalidParameterError("sampling_params", f"must be SamplingParams, got {type(params).__name__}")
        self.check_runner(params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidParameterError("priority", f"must be an integer, got {priority!r}")
        lora_request = self.lora.check(lora_request)
        prompt_ids, cache_salt = self._prompt_ids(prompt, add_special_tokens)
        pooling: PoolingParams | None = None
        if isinstance(params, PoolingParams):
            self._validate_prompt_ids(prompt_ids, room_for_output=False)
            pooling = self._resolve_pooling_params(params)
            # Never sampled with: see EngineCoreRequest.
            resolved = SamplingParams(max_tokens=1)
        else:
            self._validate_prompt_ids(prompt_ids)
            resolved = self._resolve_params(params, len(prompt_ids))
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=resolved,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            pooling_params=pooling,
            lora_request=lora_request,
        )

    def check_runner(self, params: SamplingParams | PoolingParams) -> None:
        """Generation on a generating model, pooling on a pooling one; else a
        400 naming `model` (an API route asks before it reads its input)."""
        if isinstance(params, PoolingParams) and not self.model_config.is_pooling:
            raise InvalidParameterError(
                "model",
                "this model generates text and does not support embeddings; serve it with runner='pooling' "
                "(or task='embed') for that",
            )
        if isinstance(params, SamplingParams) and self.model_config.is_pooling:
            raise InvalidParameterError(
                "model", "this model runs the pooling runner (embeddings) and does not generate text"
            )

    def _resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """A private copy with the engine's pooling type and `normalize` concrete."""
        config = self.model_config.pooler_config
        assert config is not None
        if params.dimensions is not None:
            raise InvalidParameterError(
                "dimensions", "this model does not support Matryoshka embeddings; leave dimensions unset"
            )
        if params.normalize is not None and not isinstance(params.normalize, bool):
            raise InvalidParameterError("normalize", f"must be true or false, got {params.normalize!r}")
        normalize = config.normalize if params.normalize is None else params.normalize
        return replace(params, normalize=normalize, pooling_type=config.pooling_type)

    def process_with_fanout(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> tuple[list[EngineCoreRequest], str | None]:
        """`process` then `fan_out`: the engine-core requests (n of them, or
        the request itself when n == 1) and the prompt text to echo."""
        request = self.process(
            request_id, prompt, params, arrival_time=arrival_time, priority=priority,
            add_special_tokens=add_special_tokens, lora_request=lora_request,
        )
        return fan_out(request), self.prompt_text(prompt)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The module's `render_chat` (its keyword options) with this processor's tokenizer."""
        return render_chat(self.tokenizer, messages, **options)

    def process_chat(
        self,
        request_id: str,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        **template_options: Any,
    ) -> EngineCoreRequest:
        """`render_chat(messages, **template_options)` then `process`, without
        adding special tokens a second time."""
        text = self.render_chat(messages, **template_options)
        return self.process(
            request_id, text, params, arrival_time=arrival_time, priority=priority, add_special_tokens=False
        )

    # ---- validation ------------------------------------------------------------

    def _validate_prompt_ids(self, ids: list[int], room_for_output: bool = True) -> None:
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise InvalidParameterError(
                "prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        # A prompt to generate from must leave room for at least one token.
        if len(ids) >= self.max_model_len + (0 if room_for_output else 1):
            raise PromptTooLongError(len(ids), self.max_model_len)

    def _check_ids(self, name: str, ids: Sequence[int]) -> None:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidParameterError(name, f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        if self.max_n is not None and params.n > self.max_n:
            raise InvalidParameterError("n", f"must be <= {self.max_n} (max_num_seqs), got {params.n}")
        room = self.max_model_len - prompt_len
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidParameterError(
                "max_tokens",
                f"{params.max_tokens} is more than the {room} tokens left after the "
                f"{prompt_len}-token prompt (max_model_len={self.max_model_len})",
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if params.min_tokens > max_tokens:
            raise InvalidParameterError("min_tokens", f"must be <= max_tokens ({max_tokens}), got {params.min_tokens}")
        assert params.stop_token_ids is not None
        self._check_ids("stop_token_ids", params.stop_token_ids)
        if params.logit_bias:
            self._check_ids("logit_bias", list(params.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidParameterError(name, f"must be <= {self.max_logprobs}, got {value}")
        resolved = params.clone(max_tokens=max_tokens)
        stops = set(resolved.stop_token_ids or ())
        # A finished grammar allows only stop tokens, so a constrained
        # request ends with its grammar: its EOS counts even with ignore_eos.
        if not resolved.ignore_eos or resolved.structured_outputs is not None:
            stops.update(self.eos_token_ids)
        resolved.all_stop_token_ids = stops
        if resolved.structured_outputs is not None:
            self._check_structured_outputs(resolved)
        return resolved

    @staticmethod
    def _check_structured_outputs(params: SamplingParams) -> None:
        from rayvllm.structured_output.grammar import validate

        assert params.structured_outputs is not None
        if not params.all_stop_token_ids:
            raise InvalidParameterError(
                "structured_outputs", "needs a token to end on: the model has no EOS token and no stop_token_ids were given"
            )
        validate(params.structured_outputs)


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy messages into the plain shape templates expect (string content)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidParameterError("messages", "must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidParameterError("messages", f"message {i} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidParameterError("messages", f"message {i} needs a string 'role'")
        content = message.get("content")
        if content is None:
            text = ""  # e.g. an assistant turn that only carries tool calls
        elif isinstance(content, str):
            text = content
        elif isinstance(content, Sequence):
            parts: list[str] = []
            for part in content:
                if isinstance(part, str):
                    parts.append(part)
                elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise InvalidParameterError(
                        "messages", f"message {i}: content part of type {kind!r} is not supported (text only)"
                    )
            text = "\n".join(parts)
        else:
            raise InvalidParameterError("messages", f"message {i}: content must be a string or a list of parts")
        normalized = dict(message)
        normalized["content"] = text
        out.append(normalized)
    return out
