"""OpenAI-compatible request and response models (pydantic v2).

Requests ignore fields they do not know, as vLLM does, so clients written
against newer OpenAI APIs keep working; a field of the wrong type becomes a
400 naming the field (`parse_request`). Value ranges are deliberately not
checked here: `SamplingParams` and the `Processor` own those rules, so the
offline API, the Python handle and HTTP agree on them. `to_sampling_params`
and `openai_param` translate the names in their errors back to the fields
the client actually sent. Responses spell ids and `object` as OpenAI does.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_serializer, field_validator
from pydantic import SerializerFunctionWrapHandler, model_serializer

from rayvllm.entrypoints.openai.structured_request import StructuredOutputRequestFields
from rayvllm.entrypoints.openai.tool_parsers.tool_protocol import DeltaToolCall, ToolCall, ToolRequestFields
from rayvllm.messages.errors import InvalidParameterError, RayvllmError
from rayvllm.messages.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionContentPart",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionMessageParam",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionResponseStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionResponseStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "PromptLogprob",
    "StreamOptions",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeRequest",
    "TokenizeResponse",
    "UsageInfo",
    "error_body",
    "invalid_param_from_validation_error",
    "parse_request",
    "parse_tokenize_request",
    "random_id",
    "with_param",
]


logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    """`prefix` + 32 hex digits, e.g. "cmpl-3f2a..."."""
    return f"{prefix}{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    """Base of every model here: unknown fields are dropped, not rejected."""

    # `model` is an OpenAI field name; pydantic would warn about its namespace.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ---- errors ---------------------------------------------------------------------

# Union members appear in pydantic error locations as tags ("str",
# "list[int]", "ChatCompletionContentPart"); they are not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def _field_path(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif _FIELD_NAME.fullmatch(item) and item not in _TYPE_TAGS:
            parts.append(item)
    return ".".join(parts) or "body"


def invalid_param_from_validation_error(err: ValidationError) -> InvalidParameterError:
    """The 400 for a request pydantic rejected: `param` is the dotted path of
    the first failing field ("temperature", "messages.0.role"); the message
    joins what went wrong there (several lines for a union that matched no
    member)."""
    errors = err.errors(include_url=False)
    if not errors:
        return InvalidParameterError("body", str(err))
    param = _field_path(tuple(errors[0]["loc"]))
    messages: list[str] = []
    for error in errors:
        if _field_path(tuple(error["loc"])) != param:
            continue
        message = str(error["msg"]).removeprefix("Value error, ")
        if message not in messages:
            messages.append(message)
    return InvalidParameterError(param, "; ".join(messages))


def with_param(exc: InvalidParameterError, param: str) -> InvalidParameterError:
    """`exc` (same class, same attributes) reporting `param` instead of its own
    field name; `exc` itself when the name already matches."""
    if exc.param == param:
        return exc
    message = str(exc).removeprefix(f"{exc.param}: ")
    # BaseException.__new__ skips __init__, whose signature varies by subclass
    # (PromptTooLongError takes token counts, not a message).
    renamed = type(exc).__new__(type(exc))
    renamed.__dict__.update(exc.__dict__)
    renamed.args = (f"{param}: {message}",)
    renamed.param = param
    return renamed


M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body (or raw JSON text/bytes) as `model`.

    Raises InvalidParameterError naming the field; malformed JSON names "body".
    """
    try:
        if isinstance(body, (str, bytes, bytearray)):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as e:
        raise invalid_param_from_validation_error(e) from None


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI-style body `{"error": {message, type, param, code}}`.

    The status is the `RayvllmError.status_code` and the message its
    `public_message` (a pydantic ValidationError counts as
    InvalidParameterError, 400); anything else is a 500 "internal_error"
    that says no more than that: an unexpected exception's text can hold
    anything (prompts, paths, addresses), so it belongs in the server log
    only. `code` repeats the status, as vLLM does.
    """
    if isinstance(exc, ValidationError):
        exc = invalid_param_from_validation_error(exc)
    if isinstance(exc, RayvllmError):
        status, kind = exc.status_code, exc.error_type
        param = getattr(exc, "param", None)
        message = exc.public_message
    else:
        status, kind, param = 500, "internal_error", None
        message = "internal server error"
    if message != str(exc):
        logger.error("request failed with %d: %r", status, exc, exc_info=exc)
    info = ErrorInfo(message=message, type=kind, param=param, code=status)
    return status, ErrorResponse(error=info).model_dump()


# ---- generation requests -----------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _GenerationRequest(StructuredOutputRequestFields, OpenAIBaseModel):
    """Fields both generation endpoints share, OpenAI's then vLLM's.

    None means "not sent": `SamplingParams` then applies its default, so
    there is a single place where defaults live.
    """

    # Maps SamplingParams field names to this request's names where they differ.
    _PARAM_NAMES: ClassVar[dict[str, str]] = {}

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    # The prompt's and each choice's token ids beside the text (vLLM's
    # token-in/token-out field): no re-tokenizing text for an RL trainer.
    return_token_ids: bool | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage-only chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def openai_param(self, name: str) -> str:
        """The request field a `SamplingParams`/`Processor` error about `name` is about."""
        if name.startswith("structured_outputs"):
            return self.structured_outputs_field(name)
        return self._PARAM_NAMES.get(name, name)

    def translate_error(self, exc: InvalidParameterError) -> InvalidParameterError:
        return with_param(exc, self.openai_param(exc.param))

    def _common_sampling_kwargs(self) -> dict[str, Any]:
        values: dict[str, Any] = {
            "n": self.n,
            "stop": self.stop,
            "seed": self.seed,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "prompt_logprobs": self.prompt_logprobs,
            "structured_outputs": self.structured_outputs_params(),
        }
        return {k: v for k, v in values.items() if v is not None}

    def _build_sampling_params(self, kwargs: dict[str, Any]) -> SamplingParams:
        try:
            return SamplingParams(**kwargs)
        except InvalidParameterError as e:
            renamed = self.translate_error(e)
            if renamed is e:
                raise
            raise renamed from e


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt` is text, a batch of texts, token ids or a
    batch of token-id lists; a batch gives `len(prompts) * n` choices."""

    _PARAM_NAMES: ClassVar[dict[str, str]] = {"prompt_token_ids": "prompt"}

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError("is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        # Sampling best_of > n candidates and ranking them is not implemented.
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"must be unset or equal to n ({n}); best_of > n is not supported")
        return value

    def to_sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; InvalidParameterError names the request field.

        With `echo` and `logprobs`, prompt logprobs are requested too (as many
        as `logprobs`, unless `prompt_logprobs` says otherwise): the echoed
        prompt tokens get logprobs like the generated ones.
        """
        kwargs = self._common_sampling_kwargs()
        kwargs["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:
                kwargs["prompt_logprobs"] = self.logprobs
        return self._build_sampling_params(kwargs)


class ChatCompletionContentPart(OpenAIBaseModel):
    """One part of a message's content; only "text" parts are supported (the
    Processor names any other type in its 400)."""

    type: str
    text: str | None = None


class ChatCompletionMessageParam(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatCompletionContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (unset fields left out)."""
        message = self.model_dump(exclude_none=True)
        message.setdefault("content", None)
        return message


class _ChatTemplateOptions(OpenAIBaseModel):
    """What the chat and tokenize-chat requests pass to `Processor.render_chat`."""

    messages: list[ChatCompletionMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template_dict() for m in self.messages]

    def template_options(self) -> dict[str, Any]:
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template": self.chat_template,
            "chat_template_kwargs": self.chat_template_kwargs,
        }


class ChatCompletionRequest(ToolRequestFields, _ChatTemplateOptions, _GenerationRequest):
    """POST /v1/chat/completions.

    `max_completion_tokens` wins over the deprecated `max_tokens`; neither
    means "up to max_model_len". `add_special_tokens` defaults to False
    because the rendered template already holds BOS and friends.
    """

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        # vLLM's rule: 0 asks for nothing, so it is allowed alone.
        if value and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return value

    def openai_param(self, name: str) -> str:
        if name == "logprobs":
            return "top_logprobs" if self.top_logprobs is not None else "logprobs"
        if name == "max_tokens":
            return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if name in ("prompt", "prompt_token_ids"):
            return "messages"
        if name.startswith("structured_outputs"):
            # A forced tool call's constraint is built from the tools.
            return "tools" if self.tool_choice_mode in ("required", "named") else self.structured_outputs_field(name)
        return name

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        """The request's SamplingParams; InvalidParameterError names the request
        field (`top_logprobs`, `max_completion_tokens` where those were sent)."""
        kwargs = self._common_sampling_kwargs()
        kwargs["max_tokens"] = self.effective_max_tokens
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return self._build_sampling_params(kwargs)


# ---- generation responses ------------------------------------------------------------


class PromptTokenUsageInfo(OpenAIBaseModel):
    """OpenAI's `usage.prompt_tokens_details`: `cached_tokens` of the prompt
    were served from the prefix cache, not computed."""

    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo = Field(default_factory=PromptTokenUsageInfo)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's `prompt_logprobs` entry (an extension; OpenAI has no such field)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt position, keyed by token id; the first is None.
PromptLogprobsList: TypeAlias = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token.

    `text_offset[i]` is where token i starts in the choice's text;
    `top_logprobs[i]` maps token strings to logprobs for the chosen token
    and the `logprobs` most likely ones. None marks the first prompt token
    of an echo, which has no logprob.
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _TokenIdFields(OpenAIBaseModel):
    """Base of the bodies that carry `return_token_ids`' fields
    (`prompt_token_ids`, `token_ids`): in the JSON only when set, so a
    client that did not ask sees OpenAI's shape."""

    @model_serializer(mode="wrap")
    def _without_unasked_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("prompt_token_ids", "token_ids"):
            if key in data and data[key] is None:
                del data[key]
        return data


class CompletionResponseChoice(_TokenIdFields):
    """`prompt_token_ids`, `token_ids` (the generated ones): with `return_token_ids`."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl-"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(_TokenIdFields):
    """With `return_token_ids`: `token_ids` the chunk's generated ids, and
    `prompt_token_ids` on each choice's first chunk."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One SSE chunk; `usage` is set only on the final usage-only chunk (and
    serialized as null on the others when the client asked for usage)."""

    id: str = Field(default_factory=lambda: random_id("cmpl-"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ChatMessage(OpenAIBaseModel):
    """`tool_calls` appears in the JSON only when the model called tools."""

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatCompletionLogProb(OpenAIBaseModel):
    """`bytes` are the UTF-8 bytes of `token` (OpenAI's field name)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(_TokenIdFields):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_TokenIdFields):
    """`prompt_token_ids` (the rendered conversation's) and each choice's
    `token_ids`: with `return_token_ids`."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl-"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    """What a chat chunk adds to a choice's message; unset fields are omitted
    from the JSON, so the finishing chunk's delta can be `{}`."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(_TokenIdFields):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionStreamResponse(_TokenIdFields):
    """With `return_token_ids`: `prompt_token_ids` on the stream's first
    chunk, and each chunk's choice its generated `token_ids`."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl-"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# ---- models, tokenize, detokenize ------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "rayvllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_ChatTemplateOptions):
    """Tokenizes what a chat request would send to the model."""

    model: str | None = None
    add_special_tokens: bool = False


TokenizeRequest: TypeAlias = TokenizeCompletionRequest | TokenizeChatRequest


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    """POST /tokenize takes either form; a body with `messages` is the chat form."""
    if isinstance(body, dict) and "messages" in body:
        return parse_request(TokenizeChatRequest, body)
    return parse_request(TokenizeCompletionRequest, body)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
