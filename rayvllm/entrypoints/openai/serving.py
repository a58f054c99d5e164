"""The OpenAI-compatible endpoints, free of any HTTP framework and of Ray.

`OpenAIServing` turns protocol requests into engine calls and the engine's
DELTA `RequestOutput` streams into OpenAI responses: a whole response, or
server-sent events. The HTTP app only parses bodies, calls these methods
and maps exceptions with `protocol.error_body`.

Two guarantees the HTTP layer relies on:
  * every client error (unknown model, bad parameter, prompt too long) is
    raised by `create_*` itself, before a stream is returned, so it can
    still become a 4xx status instead of an event inside a 200;
  * every engine stream is closed once its output is no longer wanted (the
    response is complete, an error happened, the coroutine was cancelled, or
    the returned event stream was closed), which is what makes the engine
    abort the request and free its KV cache.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from pydantic import BaseModel

from rayvllm.entrypoints.openai.chat_tools import ChatTools, ChoiceToolCalls
from rayvllm.entrypoints.openai.engine_client import EngineClient
from rayvllm.entrypoints.openai.logprobs import LogprobFormatter, padded, prompt_logprobs_field
from rayvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    PromptTokenUsageInfo,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from rayvllm.entrypoints.openai.serving_models import OpenAIServingModels
from rayvllm.entrypoints.openai.stream_resume import ProgressEvent, StreamResume
from rayvllm.entrypoints.openai.streams import SSE_DONE, EngineStreams, EventStream, OutputStream, sse, sse_error
from rayvllm.entrypoints.openai.template_sandbox import ClientTemplateRenderer
from rayvllm.entrypoints.openai.tool_parsers import get_tool_parser
from rayvllm.frontend.processor import PromptType, TokensPrompt
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from rayvllm.messages.sampling_params import SamplingParams

__all__ = ["EventStream", "OpenAIServing"]

logger = logging.getLogger(__name__)


# ---- bookkeeping -------------------------------------------------------------------


@dataclass
class _PromptState:
    token_ids: list[int]
    text: str | None
    # Accumulated over DELTA outputs (the engine may send them in chunks).
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    # Prefix-cache hits of the prompt; the same for every choice of it.
    num_cached_tokens: int = 0


@dataclass
class _ChoiceState:
    """One choice; text/token ids/logprobs are kept only for whole responses."""

    index: int
    prompt_index: int
    num_tokens: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_len: int = 0  # characters of generated text already streamed (completions text_offset)
    echoed: bool = False
    # The prompt's token ids were sent with this choice (`return_token_ids`).
    prompt_ids_sent: bool = False


class _Tally:
    """Folds the DELTA outputs of one API request into per-prompt and
    per-choice state. Choice index = prompt_index * n + sequence index.
    `resume`: the stream continues where another replica left it (one
    prompt, one choice): its tokens count, its text and echo were sent."""

    def __init__(self, num_prompts: int, n: int, keep_outputs: bool, resume: StreamResume | None = None) -> None:
        self.n = n
        self.keep_outputs = keep_outputs
        self.prompts: list[_PromptState | None] = [None] * num_prompts
        self.choices: dict[int, _ChoiceState] = {}
        self._resumed_cached_tokens: int | None = None
        if resume is not None:
            choice = self.choice(0)
            choice.num_tokens = len(resume.output_token_ids)
            choice.text_len = resume.text_chars
            choice.echoed = True
            choice.prompt_ids_sent = True
            self._resumed_cached_tokens = resume.num_cached_tokens

    def prompt(self, index: int) -> _PromptState:
        # A stream that ended without any output (a broken engine) reads as empty.
        return self.prompts[index] or _PromptState([], None)

    def choice(self, index: int) -> _ChoiceState:
        state = self.choices.get(index)
        if state is None:
            state = self.choices[index] = _ChoiceState(index, index // self.n)
        return state

    def absorb(self, prompt_index: int, out: RequestOutput) -> list[tuple[_ChoiceState, CompletionOutput]]:
        """Record `out`; return the choices it touched with their deltas."""
        prompt = self.prompts[prompt_index]
        if prompt is None:
            prompt = self.prompts[prompt_index] = _PromptState(list(out.prompt_token_ids), out.prompt)
        if out.prompt_logprobs:
            prompt.logprobs.extend(out.prompt_logprobs)
        prompt.num_cached_tokens = max(prompt.num_cached_tokens, out.num_cached_tokens or 0)
        touched: list[tuple[_ChoiceState, CompletionOutput]] = []
        for delta in out.outputs:
            choice = self.choice(prompt_index * self.n + delta.index)
            choice.num_tokens += len(delta.token_ids)
            if self.keep_outputs:
                choice.text.append(delta.text)
                choice.token_ids.extend(delta.token_ids)
                if delta.logprobs:
                    choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                choice.stop_reason = delta.stop_reason
            touched.append((choice, delta))
        return touched

    def usage(self) -> UsageInfo:
        # Counted once per prompt, however many choices share it.
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts if p is not None)
        completion_tokens = sum(c.num_tokens for c in self.choices.values())
        cached_tokens = self._resumed_cached_tokens
        if cached_tokens is None:
            cached_tokens = sum(p.num_cached_tokens for p in self.prompts if p is not None)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens),
        )

    def tagged(self, event: str, choice: _ChoiceState, delta: CompletionOutput) -> ProgressEvent:
        """`event` tagged with how far a resumable stream has come once it is sent."""
        return ProgressEvent(
            event, tuple(delta.token_ids), choice.text_len, self.prompt(0).num_cached_tokens,
            delta.finish_reason is not None,
        )


@contextlib.contextmanager
def _named_for(req: CompletionRequest | ChatCompletionRequest) -> Iterator[None]:
    """Re-raise engine/processor parameter errors under the request's field names."""
    try:
        yield
    except InvalidParameterError as e:
        renamed = req.translate_error(e)
        if renamed is e:
            raise
        raise renamed from e


def _response_id(prefix: str, request_id: str) -> str:
    return request_id if request_id.startswith(prefix) else f"{prefix}{request_id}"


def _stream_resume(
    resumable: bool, resume: StreamResume | None, tracked: bool, response_id: str
) -> StreamResume | None:
    """What a stream starts from when it may move replicas: where it resumes,
    or for a new `tracked` one its id and time; None when it is not tracked
    or cannot move (several prompts or choices, an echo, prompt logprobs, a
    tool-call parser: state another replica would not rebuild)."""
    if resume is not None:
        if not resumable:
            raise InvalidParameterError("resume", "only a stream of one prompt and one choice resumes")
        return resume
    return StreamResume(response_id, int(time.time())) if resumable and tracked else None


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidParameterError("prompt", "must not be empty")
    # pydantic has already made the list homogeneous; its first item tells which form it is.
    first = prompt[0]
    if isinstance(first, int):
        return [TokensPrompt(prompt_token_ids=list(cast(list[int], prompt)))]
    if isinstance(first, str):
        return list(cast(list[str], prompt))
    return [TokensPrompt(prompt_token_ids=list(ids)) for ids in cast(list[list[int]], prompt)]


# ---- the endpoints -------------------------------------------------------------------


async def _framed(
    events: AsyncGenerator[str, None],
    kind: str,
    response_id: str,
    tally: "_Tally",
    final: Callable[..., BaseModel],
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    """The frame every streamed response shares: its events; an in-band
    error event if the engine fails mid-stream (the status line is long
    gone); the usage chunk when asked (`final(usage=...)`); then [DONE]."""
    try:
        async with contextlib.aclosing(events) as body:
            async for event in body:
                yield event
    except Exception as e:
        logger.warning("%s stream %s failed: %s", kind, response_id, e)
        yield sse_error(e)
        yield SSE_DONE
        return
    if include_usage:
        yield sse(final(usage=tally.usage()), True)
    yield SSE_DONE


class OpenAIServing:
    """The logic behind /v1/completions, /v1/chat/completions, /v1/models,
    /tokenize and /detokenize for one engine serving one model.

    `served_model_names[0]` is the name used when a request names no model.
    """

    def __init__(
        self, engine: EngineClient, served_model_names: list[str], max_model_len: int,
        trust_request_chat_template: bool = False, enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None, models: OpenAIServingModels | None = None,
    ) -> None:
        """`models`: the served names, with LoRA adapters (default: `served_model_names` alone).
        `trust_request_chat_template`: accept a `chat_template` in requests
        (otherwise such a request is a 400 naming the field).
        `enable_auto_tool_choice`, `tool_call_parser`: vLLM's options; the
        model may then call tools on its own (`tool_choice="auto"`), found
        in its text by that parser (chat_tools.py)."""
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # an unknown name fails the start, not every request
        self.engine = engine
        self.trust_request_chat_template = trust_request_chat_template
        # Templates from requests run in a child process, bounded (template_sandbox.py).
        self._client_templates = ClientTemplateRenderer(engine.tokenizer) if trust_request_chat_template else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self.models = models or OpenAIServingModels(self.served_model_names, max_model_len, engine.model_path)
        self._logprobs = LogprobFormatter(engine.tokenizer)

    # ---- helpers -----------------------------------------------------------------

    def _model_name(self, requested: str | None) -> str:
        return self.models.resolve(requested)[0]

    def _prompt_text(self, prompt: _PromptState) -> str:
        if prompt.text is not None:
            return prompt.text
        return str(self.engine.tokenizer.decode(prompt.token_ids))

    async def _start(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        request_id: str,
        resume: StreamResume | None = None,
        whole: bool = False,
    ) -> EngineStreams:
        """The engine's streams of `prompts`. `whole`: the response is sent
        whole, so each request's output is needed only at its end (FINAL_ONLY,
        `final_only`: the engine sends nothing between its first token and
        its last)."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        point = resume.point() if resume is not None else None
        kind = RequestOutputKind.FINAL_ONLY if whole else RequestOutputKind.DELTA
        created: list[OutputStream] = []
        _, lora = self.models.resolve(req.model)
        try:
            with _named_for(req):
                for prompt, engine_id in zip(prompts, ids):
                    created.append(
                        self.engine.add_request(
                            prompt, params, engine_id, add_special_tokens=req.add_special_tokens, lora_request=lora,
                            resume=point, output_kind=kind, final_only=whole,
                        )
                    )
        except BaseException:
            await EngineStreams(created).aclose()
            raise
        return EngineStreams(created)

    # ---- /v1/completions ----------------------------------------------------------

    async def create_completion(
        self, req: CompletionRequest, request_id: str, resume: StreamResume | None = None, tracked: bool = False
    ) -> CompletionResponse | EventStream:
        """A CompletionResponse, or with `stream` an `EventStream` of SSE strings.

        Raises (before any stream exists) ModelNotFoundError for an unknown
        model and InvalidParameterError/PromptTooLongError naming the field.
        Engine request ids: `request_id` for one prompt, else
        `f"{request_id}-{prompt_index}"`. `tracked`: a stream that may move
        to another replica tags its events (`EventStream.resume` is set);
        `resume`: continue one that another replica began.
        """
        model = self._model_name(req.model)
        with _named_for(req):
            params = req.to_sampling_params()
            prompts = _completion_prompts(req.prompt)
            resumable = req.stream and len(prompts) == 1 and params.n == 1 and not req.echo
            response_id = _response_id("cmpl-", request_id)
            progress = _stream_resume(resumable and req.prompt_logprobs is None, resume, tracked, response_id)
        streams = await self._start(req, prompts, params, request_id, resume, whole=not req.stream)
        tally = _Tally(len(prompts), params.n, keep_outputs=not req.stream, resume=resume)
        response_id = progress.response_id if progress else response_id
        created = progress.created if progress else int(time.time())
        if req.stream:
            events = self._completion_events(req, streams, tally, response_id, created, model, progress is not None)
            final = partial(CompletionStreamResponse, id=response_id, created=created, model=model, choices=[])
            framed = _framed(events, "completion", response_id, tally, final, req.include_usage)
            return EventStream(framed, streams.aclose, progress)
        async with contextlib.aclosing(streams.outputs()) as outputs:
            async for prompt_index, out in outputs:
                tally.absorb(prompt_index, out)
        choices = [self._completion_choice(req, tally, index) for index in range(len(prompts) * params.n)]
        return CompletionResponse(id=response_id, created=created, model=model, choices=choices, usage=tally.usage())

    def _completion_choice(self, req: CompletionRequest, tally: _Tally, index: int) -> CompletionResponseChoice:
        choice = tally.choice(index)
        prompt = tally.prompt(choice.prompt_index)
        text = "".join(choice.text)
        token_ids: list[int] = choice.token_ids
        logprobs = padded(choice.logprobs, len(token_ids))
        if req.echo:
            text = self._prompt_text(prompt) + text
            token_ids = prompt.token_ids + token_ids
            logprobs = padded(prompt.logprobs, len(prompt.token_ids)) + logprobs
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=(
                self._logprobs.completion(token_ids, logprobs, req.logprobs, 0) if req.logprobs is not None else None
            ),
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_logprobs=prompt_logprobs_field(prompt.logprobs) if req.prompt_logprobs is not None else None,
            prompt_token_ids=prompt.token_ids if req.return_token_ids else None,
            token_ids=choice.token_ids if req.return_token_ids else None,
        )

    async def _completion_events(
        self,
        req: CompletionRequest,
        streams: EngineStreams,
        tally: _Tally,
        response_id: str,
        created: int,
        model: str,
        tag: bool,
    ) -> AsyncGenerator[str, None]:
        """The stream's events; `tag`: each a `ProgressEvent`, for a stream that may move replicas."""
        include_usage = req.include_usage
        async with contextlib.aclosing(streams.outputs()) as outputs:
            async for prompt_index, out in outputs:
                for choice, delta in tally.absorb(prompt_index, out):
                    chunk = self._completion_chunk(req, tally, choice, delta)
                    if chunk is None:
                        continue
                    response = CompletionStreamResponse(
                        id=response_id, created=created, model=model, choices=[chunk]
                    )
                    event = sse(response, include_usage)
                    yield tally.tagged(event, choice, delta) if tag else event

    def _completion_chunk(
        self, req: CompletionRequest, tally: _Tally, choice: _ChoiceState, delta: CompletionOutput
    ) -> CompletionResponseStreamChoice | None:
        """The stream choice for one delta; None when it carries nothing."""
        text = delta.text
        token_ids = list(delta.token_ids)
        logprobs = padded(delta.logprobs or [], len(token_ids))
        if req.echo and not choice.echoed:
            choice.echoed = True
            prompt = tally.prompt(choice.prompt_index)
            text = self._prompt_text(prompt) + text
            token_ids = prompt.token_ids + token_ids
            logprobs = padded(prompt.logprobs, len(prompt.token_ids)) + logprobs
        elif not text and not token_ids and delta.finish_reason is None:
            return None
        chunk_logprobs = None
        if req.logprobs is not None:
            chunk_logprobs = self._logprobs.completion(token_ids, logprobs, req.logprobs, choice.text_len)
        choice.text_len += len(text)
        prompt_token_ids = None
        if req.return_token_ids and not choice.prompt_ids_sent:
            choice.prompt_ids_sent = True
            prompt_token_ids = tally.prompt(choice.prompt_index).token_ids
        return CompletionResponseStreamChoice(
            index=choice.index,
            text=text,
            logprobs=chunk_logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            prompt_token_ids=prompt_token_ids,
            token_ids=list(delta.token_ids) if req.return_token_ids else None,
        )

    # ---- /v1/chat/completions -------------------------------------------------------

    async def create_chat_completion(
        self, req: ChatCompletionRequest, request_id: str, resume: StreamResume | None = None, tracked: bool = False
    ) -> ChatCompletionResponse | EventStream:
        """A ChatCompletionResponse, or with `stream` an `EventStream` of SSE strings.

        The conversation is rendered with the chat template and sent as text
        (tokenized with `req.add_special_tokens`, False by default). Errors
        are raised before any stream exists, as for `create_completion`;
        `tracked` and `resume` as there.
        """
        model = self._model_name(req.model)
        with _named_for(req):
            tools = ChatTools.from_request(req, self.enable_auto_tool_choice, self.tool_call_parser)
            params = self._with_tool_constraint(req.to_sampling_params(), tools)
            prompt = await self._render_chat(req, req.template_tools())
            resumable = req.stream and params.n == 1 and tools is None and req.prompt_logprobs is None
            response_id = _response_id("chatcmpl-", request_id)
            progress = _stream_resume(resumable, resume, tracked, response_id)
        streams = await self._start(req, [prompt], params, request_id, resume, whole=not req.stream)
        tally = _Tally(1, params.n, keep_outputs=not req.stream, resume=resume)
        response_id = progress.response_id if progress else response_id
        created = progress.created if progress else int(time.time())
        if req.stream:
            events = self._chat_events(
                req, streams, tally, response_id, created, model, tools, progress is not None, resume is not None
            )
            final = partial(ChatCompletionStreamResponse, id=response_id, created=created, model=model, choices=[])
            framed = _framed(events, "chat", response_id, tally, final, req.include_usage)
            return EventStream(framed, streams.aclose, progress)
        async with contextlib.aclosing(streams.outputs()) as outputs:
            async for prompt_index, out in outputs:
                tally.absorb(prompt_index, out)
        choices = [self._chat_choice(req, tally, index, tools) for index in range(params.n)]
        prompt_state = tally.prompt(0)
        return ChatCompletionResponse(
            id=response_id,
            created=created,
            model=model,
            choices=choices,
            usage=tally.usage(),
            prompt_logprobs=(
                prompt_logprobs_field(prompt_state.logprobs) if req.prompt_logprobs is not None else None
            ),
            prompt_token_ids=prompt_state.token_ids if req.return_token_ids else None,
        )

    @staticmethod
    def _with_tool_constraint(params: SamplingParams, tools: ChatTools | None) -> SamplingParams:
        if tools is None or tools.constraint is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidParameterError(
                "tool_choice", f'"{tools.mode}" cannot be combined with another structured output (response_format, text.format)'
            )
        return params.clone(structured_outputs=tools.constraint)

    def _chat_choice(
        self, req: ChatCompletionRequest, tally: _Tally, index: int, tools: ChatTools | None
    ) -> ChatCompletionResponseChoice:
        choice = tally.choice(index)
        logprobs = None
        if req.logprobs:
            logprobs = self._logprobs.chat(choice.token_ids, choice.logprobs, req.top_logprobs or 0)
        content: str | None = "".join(choice.text)
        tool_calls = []
        if tools is not None:
            assert content is not None
            content, tool_calls = tools.for_choice().whole(content)
        return ChatCompletionResponseChoice(
            index=index,
            message=ChatMessage(role="assistant", content=content, tool_calls=tool_calls),
            logprobs=logprobs,
            finish_reason=ChatTools.finish_reason(choice.finish_reason, bool(tool_calls)),
            stop_reason=choice.stop_reason,
            token_ids=choice.token_ids if req.return_token_ids else None,
        )

    async def _chat_events(
        self,
        req: ChatCompletionRequest,
        streams: EngineStreams,
        tally: _Tally,
        response_id: str,
        created: int,
        model: str,
        tools: ChatTools | None,
        tag: bool,
        resumed: bool,
    ) -> AsyncGenerator[str, None]:
        """The stream's events; `tag` as for completions; `resumed`: the
        opening (the role) was sent by the replica that began it."""
        include_usage = req.include_usage
        # Per choice: its tool-call parser and whether it has called a tool.
        tool_states: dict[int, ChoiceToolCalls] = {}
        called: set[int] = set()

        def chunk(choice: ChatCompletionResponseStreamChoice, prompt_token_ids: list[int] | None = None) -> str:
            response = ChatCompletionStreamResponse(
                id=response_id, created=created, model=model, choices=[choice], prompt_token_ids=prompt_token_ids
            )
            return sse(response, include_usage)

        def roles(prompt_token_ids: list[int] | None) -> Iterator[str]:
            """The role, once per choice, before any content (OpenAI's order);
            the prompt's token ids, where asked for, on the first."""
            role = DeltaMessage(role="assistant", content="")
            for index in range(tally.n):
                yield chunk(ChatCompletionResponseStreamChoice(index=index, delta=role), prompt_token_ids)
                prompt_token_ids = None

        # Without token ids the roles go at once; with them, once the
        # engine's first output has brought the prompt's ids.
        roles_due = not resumed
        if roles_due and not req.return_token_ids:
            roles_due = False
            for event in roles(None):
                yield event
        async with contextlib.aclosing(streams.outputs()) as outputs:
            async for prompt_index, out in outputs:
                if roles_due:
                    roles_due = False
                    for event in roles(list(out.prompt_token_ids)):
                        yield event
                for choice, delta in tally.absorb(prompt_index, out):
                    if not delta.text and not delta.token_ids and delta.finish_reason is None:
                        continue
                    choice.text_len += len(delta.text)
                    logprobs = None
                    if req.logprobs:
                        logprobs = self._logprobs.chat(
                            delta.token_ids, delta.logprobs or [], req.top_logprobs or 0
                        )
                    content = delta.text if (delta.text or delta.token_ids) else None
                    message = DeltaMessage(content=content)
                    finish_reason = delta.finish_reason
                    if tools is not None:
                        state = tool_states.setdefault(choice.index, tools.for_choice())
                        part = state.stream(delta.text, final=delta.finish_reason is not None)
                        if part.tool_calls:
                            called.add(choice.index)
                        message = DeltaMessage(content=part.content or None, tool_calls=part.tool_calls or None)
                        finish_reason = ChatTools.finish_reason(finish_reason, choice.index in called)
                        nothing = message.content is None and message.tool_calls is None and finish_reason is None
                        # Held-back tool-call text still brings its token ids, where asked for.
                        if nothing and not req.return_token_ids:
                            continue
                    event = chunk(
                        ChatCompletionResponseStreamChoice(
                            index=choice.index,
                            delta=message,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=delta.stop_reason,
                            token_ids=list(delta.token_ids) if req.return_token_ids else None,
                        )
                    )
                    yield tally.tagged(event, choice, delta) if tag else event

    # ---- /v1/models, /tokenize, /detokenize -----------------------------------------------

    def show_models(self) -> ModelList:
        return self.models.show_models()

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of a conversation rendered as a chat
        request would render it (then added special tokens default to off)."""
        self._model_name(req.model)
        if isinstance(req, TokenizeChatRequest):
            text = await self._render_chat(req)
        else:
            text = req.prompt
        tokens = self.engine.tokenize(text, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    async def _render_chat(
        self, req: ChatCompletionRequest | TokenizeChatRequest, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The conversation (and `tools`) as prompt text: with the server's
        template here, with a request's own (if the operator trusts them) in
        the sandbox."""
        options = {**req.template_options(), "tools": tools}
        if req.chat_template is None:
            return self.engine.render_chat(req.template_messages(), **options)
        if self._client_templates is None:
            raise InvalidParameterError(
                "chat_template",
                "this server does not take chat templates from requests (server option trust_request_chat_template)",
            )
        return await self._client_templates.render(req.template_messages(), options)

    def close(self) -> None:
        """Stop the client-template child, if one runs."""
        if self._client_templates is not None:
            self._client_templates.close()

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._model_name(req.model)
        vocab_size = self.engine.vocab_size
        for token_id in req.tokens:
            if not 0 <= token_id < vocab_size:
                raise InvalidParameterError(
                    "tokens", f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )
        return DetokenizeResponse(prompt=str(self.engine.tokenizer.decode(req.tokens)))
