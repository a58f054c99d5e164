"""OpenAIServing against a scripted engine: exact response JSON and usage,
SSE framing, choice indices, logprob formats, errors before and during
streams, and aborts (stream closed) when the client goes away.

The fake engine validates with the real `Processor` of the demo model (so
errors and prompt token ids are the real ones) and yields scripted DELTA
outputs: sequence j of a request generates `GEN[j]` (cut at max_tokens),
starting at step j, so early and late steps carry only some indices.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from rayvllm.config import ModelConfig
from rayvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
)
from rayvllm.entrypoints.openai.serving import EventStream, OpenAIServing
from rayvllm.entrypoints.openai.streams import SSE_DONE
from rayvllm.frontend.processor import Processor, PromptType
from rayvllm.messages.errors import EngineDeadError, InvalidParameterError, ModelNotFoundError, PromptTooLongError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.resume import ResumePoint
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.utils.demo import demo_model_path
from rayvllm.utils.tokenizer import get_tokenizer

from processor_engine import ProcessorEngine

MAX_MODEL_LEN = 64
MODEL = "demo"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
CHOSEN_LOGPROB = -0.1
UNLIKELY_LOGPROB = -3.0  # odd positions: the chosen token is outside the top-k


class FakeStream:
    """One admitted request's scripted outputs; on close it records the
    request as finished (its last output was read) or aborted."""

    def __init__(self, engine: "FakeEngine", request_id: str, outputs: AsyncIterator[RequestOutput]) -> None:
        self.engine = engine
        self.request_id = request_id
        self.outputs = outputs
        self.done = False
        self.closed = False

    def __aiter__(self) -> "FakeStream":
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self.outputs.__anext__()
        except EngineDeadError:
            self.done = True  # nothing left to abort
            raise
        self.done = out.finished
        return out

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            (self.engine.finished if self.done else self.engine.aborted).append(self.request_id)
            await self.outputs.aclose()


class FakeEngine(ProcessorEngine):
    """`EngineClient` with scripted outputs, each step's DELTA or, for a
    FINAL_ONLY request, the steps folded into one at its end; records what
    it was asked (and how: `kinds`, request id -> (output kind,
    final_only)) and which streams were closed before their end (= aborted)."""

    def __init__(self, processor: Processor, gen: list[list[int]], alt: list[int]) -> None:
        super().__init__(processor, MODEL)
        self.gen = gen
        self.alt = alt
        self.requests: list[EngineCoreRequest] = []
        self.kinds: dict[str, tuple[RequestOutputKind, bool]] = {}
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.fail_after_steps: int | None = None
        # When set, no output is produced until it is (a first token still being computed).
        self.gate: asyncio.Event | None = None
        # When set, each stream stops after its first output (mid-generation),
        # puts its request id here and waits until it is closed.
        self.held: asyncio.Queue[str] | None = None

    def add_request(
        self, prompt: PromptType, params: SamplingParams, request_id: str, *, add_special_tokens: bool = True,
        lora_request: LoRARequest | None = None, resume: ResumePoint | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA, final_only: bool = False,
    ) -> "FakeStream":
        """Validates at once, as `AsyncLLM.add_request` does (and resumes nothing)."""
        assert resume is None
        request = self.processor.process(
            request_id, prompt, params, add_special_tokens=add_special_tokens, lora_request=lora_request
        )
        self.requests.append(request)
        self.kinds[request_id] = (output_kind, final_only)
        outputs = self._run(request, Processor.prompt_text(prompt), output_kind is RequestOutputKind.FINAL_ONLY)
        return FakeStream(self, request_id, outputs)

    async def _run(
        self, request: EngineCoreRequest, prompt_text: str | None, final: bool
    ) -> AsyncIterator[RequestOutput]:
        if self.gate is not None:
            await self.gate.wait()
        steps: list[RequestOutput] = []
        for number, output in enumerate(self._script(request, prompt_text)):
            if self.fail_after_steps is not None and number == self.fail_after_steps:
                raise EngineDeadError("the engine died")
            if self.held is not None and number == 1:
                self.held.put_nowait(request.request_id)
                await asyncio.Event().wait()  # never set: only closing the stream ends this
            await asyncio.sleep(0)  # a step boundary: the other streams' outputs interleave
            if not final:
                yield output
            steps.append(output)
        if final:
            yield _folded(steps)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def _step_logprobs(self, token_id: int, position: int, k: int) -> dict[int, Logprob]:
        """Shaped like the OutputProcessor's: chosen first, then the top k."""
        decode = self.decode
        if position % 2 == 0:  # chosen is the most likely token
            step = {token_id: Logprob(CHOSEN_LOGPROB, 1, decode([token_id]))}
            for r, alt in enumerate(self.alt[: max(k - 1, 0)], start=2):
                step[alt] = Logprob(-1.0 - r, r, decode([alt]))
            return step
        step = {token_id: Logprob(UNLIKELY_LOGPROB, k + 1, decode([token_id]))}
        for r, alt in enumerate(self.alt[:k], start=1):
            step[alt] = Logprob(-0.5 - r, r, decode([alt]))
        return step

    def _script(self, request: EngineCoreRequest, prompt_text: str | None) -> Iterator[RequestOutput]:
        params = request.sampling_params
        assert params.max_tokens is not None
        seqs = [self.gen[j][: params.max_tokens] for j in range(params.n)]
        num_steps = max(j + len(seq) for j, seq in enumerate(seqs))
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                self._step_logprobs(t, 1, params.prompt_logprobs) for t in request.prompt_token_ids[1:]
            ]
        for step in range(num_steps):
            outputs = []
            for j, seq in enumerate(seqs):
                position = step - j
                if not 0 <= position < len(seq):
                    continue
                token = seq[position]
                last = position == len(seq) - 1
                outputs.append(
                    CompletionOutput(
                        index=j,
                        text=self.decode([token]),
                        token_ids=[token],
                        cumulative_logprob=None,
                        logprobs=(
                            [self._step_logprobs(token, position, params.logprobs)]
                            if params.logprobs is not None
                            else None
                        ),
                        finish_reason=("length" if len(seq) == params.max_tokens else "stop") if last else None,
                    )
                )
            yield RequestOutput(
                request_id=request.request_id,
                prompt=prompt_text,
                prompt_token_ids=request.prompt_token_ids,
                prompt_logprobs=prompt_logprobs if step == 0 else None,
                outputs=outputs,
                finished=step == num_steps - 1,
                num_cached_tokens=cached_tokens(request.prompt_token_ids),
            )


def _folded(steps: list[RequestOutput]) -> RequestOutput:
    """A request's DELTA outputs as the one FINAL_ONLY output at its end."""
    choices: dict[int, CompletionOutput] = {}
    for step in steps:
        for delta in step.outputs:
            whole = choices.get(delta.index)
            if whole is None:
                choices[delta.index] = replace(delta, token_ids=list(delta.token_ids),
                                               logprobs=list(delta.logprobs) if delta.logprobs is not None else None)
                continue
            whole.text += delta.text
            whole.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None and whole.logprobs is not None:
                whole.logprobs.extend(delta.logprobs)
            whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
    return replace(steps[-1], prompt_logprobs=steps[0].prompt_logprobs, outputs=[choices[i] for i in sorted(choices)])


# ---- fixtures and helpers --------------------------------------------------------------


def cached_tokens(prompt_token_ids: list[int]) -> int:
    """The fake engine's prefix-cache hits: half of every prompt."""
    return len(prompt_token_ids) // 2


@pytest.fixture(scope="module")
def processor() -> Processor:
    path: Path = demo_model_path()
    config = ModelConfig.from_path(str(path), None, "auto", MAX_MODEL_LEN, 0, "cpu")
    return Processor(config, get_tokenizer(path))


@pytest.fixture()
def engine(processor: Processor) -> FakeEngine:
    ids = processor.tokenize(" the quick brown fox jumps over the lazy dog and runs far away", False)
    assert len(ids) >= 12
    gen = [ids[0:3], ids[3:6], ids[6:9], ids[9:12]]
    return FakeEngine(processor, gen, alt=[ids[10], ids[11], ids[12] if len(ids) > 12 else ids[1]])


@pytest.fixture()
def serving(engine: FakeEngine) -> OpenAIServing:
    return OpenAIServing(engine, [MODEL, "alias"], MAX_MODEL_LEN)


def expected_text(engine: FakeEngine, seq: int, max_tokens: int = 16) -> str:
    return "".join(engine.decode([t]) for t in engine.gen[seq][:max_tokens])


def parse_events(events: list[str]) -> list[dict[str, Any]]:
    """Check SSE framing; return the JSON payloads (without [DONE])."""
    assert events[-1] == "data: [DONE]\n\n"
    assert events.count("data: [DONE]\n\n") == 1
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
        payloads.append(json.loads(event[len("data: ") : -2]))
    return payloads


def completion_req(**body: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": MODEL, **body})


def chat_req(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": MESSAGES, **body})


def complete(serving: OpenAIServing, request_id: str = "cmpl-test", **body: Any) -> CompletionResponse:
    response = asyncio.run(serving.create_completion(completion_req(**body), request_id))
    assert isinstance(response, CompletionResponse)
    return response


def chat(serving: OpenAIServing, request_id: str = "chatcmpl-test", **body: Any) -> ChatCompletionResponse:
    response = asyncio.run(serving.create_chat_completion(chat_req(**body), request_id))
    assert isinstance(response, ChatCompletionResponse)
    return response


def stream_events(serving: OpenAIServing, request_id: str, req: CompletionRequest | ChatCompletionRequest) -> list[str]:
    async def run() -> list[str]:
        stream = await (
            serving.create_completion(req, request_id)
            if isinstance(req, CompletionRequest)
            else serving.create_chat_completion(req, request_id)
        )
        assert isinstance(stream, EventStream)
        return [event async for event in stream]

    return asyncio.run(run())


# ---- /v1/completions ----------------------------------------------------------------------


def test_completion_response_json_and_usage(serving: OpenAIServing, engine: FakeEngine) -> None:
    response = complete(serving, prompt="hello world", max_tokens=3)
    assert isinstance(response, CompletionResponse)
    body = response.model_dump(mode="json")
    prompt_len = len(engine.processor.tokenize("hello world"))
    assert isinstance(body.pop("created"), int)
    assert body == {
        "id": "cmpl-test",
        "object": "text_completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": expected_text(engine, 0, 3),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": 3, "total_tokens": prompt_len + 3,
                  "prompt_tokens_details": {"cached_tokens": prompt_len // 2}},
    }
    assert [r.request_id for r in engine.requests] == ["cmpl-test"]
    assert engine.finished == ["cmpl-test"] and engine.aborted == []


def test_a_whole_response_asks_the_engine_for_final_outputs_only(serving: OpenAIServing, engine: FakeEngine) -> None:
    """Sent whole, a response needs each request's output only at its end
    (FINAL_ONLY, `final_only`: the engine sends nothing in between); its
    choices equal what a stream of the same request sends piece by piece."""
    body = dict(prompt="hello world", n=2, max_tokens=5, logprobs=2)
    whole = complete(serving, "w", **body)
    events = stream_events(serving, "s", completion_req(**body, stream=True))
    assert engine.kinds == {"w": (RequestOutputKind.FINAL_ONLY, True), "s": (RequestOutputKind.DELTA, False)}
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for event in events[:-1]:
        for choice in json.loads(event.removeprefix("data: "))["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    assert [(c.text, c.logprobs.tokens) for c in whole.choices] == [(texts[i], tokens[i]) for i in (0, 1)]
    assert whole.usage.completion_tokens == len(tokens[0]) + len(tokens[1])


def test_multi_prompt_with_n_choice_indices_and_usage(serving: OpenAIServing, engine: FakeEngine) -> None:
    prompts = ["hello world", "the cat sat"]
    response = complete(serving, "r", prompt=prompts, n=2, max_tokens=16)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    # choice = prompt_index * n + sequence index
    assert [c.text for c in response.choices] == [expected_text(engine, j) for j in (0, 1, 0, 1)]
    assert [c.finish_reason for c in response.choices] == ["stop"] * 4
    assert sorted(r.request_id for r in engine.requests) == ["r-0", "r-1"]
    prompt_tokens = sum(len(engine.processor.tokenize(p)) for p in prompts)  # once per prompt, not per n
    assert response.usage.model_dump() == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        "prompt_tokens_details": {"cached_tokens": sum(cached_tokens(engine.processor.tokenize(p)) for p in prompts)},
    }
    assert sorted(engine.finished) == ["r-0", "r-1"] and engine.aborted == []


def test_token_id_prompts(serving: OpenAIServing, engine: FakeEngine) -> None:
    ids_a = engine.processor.tokenize("hello world")
    ids_b = engine.processor.tokenize("a b c")
    single = complete(serving, "one", prompt=ids_a, max_tokens=2)
    assert engine.requests[0].prompt_token_ids == ids_a
    assert single.usage.prompt_tokens == len(ids_a)
    batch = complete(serving, "two", prompt=[ids_a, ids_b], max_tokens=2)
    assert sorted((r.request_id, len(r.prompt_token_ids)) for r in engine.requests[1:]) == [
        ("two-0", len(ids_a)),
        ("two-1", len(ids_b)),
    ]
    assert batch.usage.prompt_tokens == len(ids_a) + len(ids_b)
    echoed = complete(serving, "three", prompt=ids_b, max_tokens=2, echo=True)
    assert echoed.choices[0].text == engine.decode(ids_b) + expected_text(engine, 0, 2)


def test_missing_model_means_the_first_served_name(serving: OpenAIServing) -> None:
    assert complete(serving, "x", model=None, prompt="hi", max_tokens=1).model == MODEL
    assert complete(serving, "y", model="alias", prompt="hi", max_tokens=1).model == "alias"


def test_completion_echo(serving: OpenAIServing, engine: FakeEngine) -> None:
    response = complete(serving, prompt="hello world", max_tokens=2, echo=True)
    assert response.choices[0].text == "hello world" + expected_text(engine, 0, 2)
    req = completion_req(prompt="hello world", max_tokens=2, echo=True, stream=True)
    chunks = parse_events(stream_events(serving, "s", req))
    assert chunks[0]["choices"][0]["text"].startswith("hello world")
    assert "".join(c["choices"][0]["text"] for c in chunks) == response.choices[0].text


def test_completion_logprobs(serving: OpenAIServing, engine: FakeEngine) -> None:
    response = complete(serving, prompt="hello world", max_tokens=3, logprobs=2)
    lp = response.choices[0].logprobs
    assert lp is not None
    tokens = [engine.decode([t]) for t in engine.gen[0][:3]]
    alts = [engine.decode([t]) for t in engine.alt]
    assert lp.tokens == tokens
    assert lp.token_logprobs == [CHOSEN_LOGPROB, UNLIKELY_LOGPROB, CHOSEN_LOGPROB]
    assert lp.text_offset == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    # The 2 most likely tokens, plus the chosen one when it is not among them.
    assert lp.top_logprobs[0] == {tokens[0]: CHOSEN_LOGPROB, alts[0]: -3.0}
    assert lp.top_logprobs[1] == {alts[0]: -1.5, alts[1]: -2.5, tokens[1]: UNLIKELY_LOGPROB}
    assert engine.requests[0].sampling_params.prompt_logprobs is None


def test_completion_echo_with_logprobs_covers_the_prompt(serving: OpenAIServing, engine: FakeEngine) -> None:
    prompt_ids = engine.processor.tokenize("hello world")
    response = complete(serving, prompt="hello world", max_tokens=2, logprobs=1, echo=True)
    assert engine.requests[0].sampling_params.prompt_logprobs == 1
    lp = response.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(prompt_ids) + 2
    # The first prompt token has no logprob; every other position has one.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert lp.tokens[: len(prompt_ids)] == [engine.decode([t]) for t in prompt_ids]
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_completion_stream_framing_indices_and_usage(serving: OpenAIServing, engine: FakeEngine) -> None:
    prompts = ["hello world", "the cat sat"]
    req = completion_req(prompt=prompts, n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
    chunks = parse_events(stream_events(serving, "cmpl-s", req))
    *content, final = chunks
    assert {c["id"] for c in chunks} == {"cmpl-s"}
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in content)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for c in content:
        choice = c["choices"][0]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert texts == {i: expected_text(engine, i % 2, 3) for i in range(4)}
    assert finishes == {i: ["length"] for i in range(4)}
    prompt_tokens = sum(len(engine.processor.tokenize(p)) for p in prompts)
    assert final["choices"] == []
    assert final["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        "prompt_tokens_details": {"cached_tokens": sum(cached_tokens(engine.processor.tokenize(p)) for p in prompts)},
    }
    assert engine.aborted == []


def test_stream_without_include_usage_has_no_usage_key(serving: OpenAIServing) -> None:
    req = completion_req(prompt="hello", max_tokens=2, stream=True)
    chunks = parse_events(stream_events(serving, "s", req))
    assert chunks and all("usage" not in c and c["choices"] for c in chunks)


def test_stream_logprob_offsets_run_over_the_choice_text(serving: OpenAIServing, engine: FakeEngine) -> None:
    req = completion_req(prompt="hello", max_tokens=3, logprobs=0, stream=True)
    chunks = parse_events(stream_events(serving, "s", req))
    seen = 0
    for c in chunks:
        choice = c["choices"][0]
        assert choice["logprobs"]["text_offset"] == [seen]
        assert choice["logprobs"]["tokens"] == [choice["text"]]
        assert len(choice["logprobs"]["top_logprobs"][0]) == 1  # logprobs=0: just the chosen token
        seen += len(choice["text"])


def test_completion_return_token_ids(serving: OpenAIServing, engine: FakeEngine) -> None:
    """vLLM's token-in/token-out fields: each choice its prompt's ids and
    its generated ids, echo or not; absent unless asked for."""
    prompts = ["hello world", "the cat sat"]
    response = complete(serving, prompt=prompts, n=2, max_tokens=3, echo=True, return_token_ids=True)
    for choice in response.choices:
        prompt = prompts[choice.index // 2]
        assert choice.prompt_token_ids == engine.processor.tokenize(prompt)
        assert choice.token_ids == engine.gen[choice.index % 2][:3]
    body = complete(serving, prompt="hello", max_tokens=2).model_dump(mode="json")
    assert not {"prompt_token_ids", "token_ids"} & set(body["choices"][0])


def test_completion_stream_return_token_ids(serving: OpenAIServing, engine: FakeEngine) -> None:
    """Streamed: each chunk the ids it adds, each choice's prompt ids on its first chunk only."""
    prompts = ["hello world", "the cat sat"]
    req = completion_req(prompt=prompts, n=2, max_tokens=3, stream=True, return_token_ids=True)
    ids: dict[int, list[int]] = {}
    prompt_ids: dict[int, list[list[int]]] = {}
    for c in parse_events(stream_events(serving, "cmpl-s", req)):
        choice = c["choices"][0]
        if "prompt_token_ids" in choice:
            assert choice["index"] not in ids, "the prompt's ids come on the choice's first chunk"
            prompt_ids.setdefault(choice["index"], []).append(choice["prompt_token_ids"])
        ids.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert ids == {i: engine.gen[i % 2][:3] for i in range(4)}
    assert prompt_ids == {i: [engine.processor.tokenize(prompts[i // 2])] for i in range(4)}


# ---- /v1/chat/completions -------------------------------------------------------------------


def test_chat_completion_response(serving: OpenAIServing, engine: FakeEngine) -> None:
    response = chat(serving)
    assert isinstance(response, ChatCompletionResponse)
    rendered = engine.processor.render_chat(MESSAGES)
    prompt_ids = engine.processor.tokenize(rendered, add_special_tokens=False)
    assert engine.requests[0].prompt_token_ids == prompt_ids
    # No max_tokens: up to max_model_len.
    assert engine.requests[0].sampling_params.max_tokens == MAX_MODEL_LEN - len(prompt_ids)
    body = response.model_dump(mode="json")
    body.pop("created")
    assert body == {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": expected_text(engine, 0)},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 3, "total_tokens": len(prompt_ids) + 3,
                  "prompt_tokens_details": {"cached_tokens": cached_tokens(prompt_ids)}},
        "prompt_logprobs": None,
    }


def test_chat_max_completion_tokens_wins(serving: OpenAIServing, engine: FakeEngine) -> None:
    response = chat(serving, max_tokens=5, max_completion_tokens=2, n=2)
    assert engine.requests[0].sampling_params.max_tokens == 2
    assert [c.message.content for c in response.choices] == [expected_text(engine, j, 2) for j in (0, 1)]
    assert [c.finish_reason for c in response.choices] == ["length", "length"]
    assert response.usage.completion_tokens == 4


def test_chat_stream(serving: OpenAIServing, engine: FakeEngine) -> None:
    req = chat_req(n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
    chunks = parse_events(stream_events(serving, "chatcmpl-s", req))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {"chatcmpl-s"}
    *content, final = chunks
    # The role first, once per choice.
    assert [c["choices"][0]["delta"] for c in content[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in content[:2]] == [0, 1]
    texts = {0: "", 1: ""}
    for c in content[2:]:
        choice = c["choices"][0]
        assert set(choice["delta"]) <= {"content"}
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {j: expected_text(engine, j, 3) for j in (0, 1)}
    finishing = [c["choices"][0] for c in content if c["choices"][0]["finish_reason"] is not None]
    assert sorted((f["index"], f["finish_reason"]) for f in finishing) == [(0, "length"), (1, "length")]
    prompt_len = len(engine.requests[0].prompt_token_ids)
    assert final == {
        "id": "chatcmpl-s",
        "object": "chat.completion.chunk",
        "created": final["created"],
        "model": MODEL,
        "choices": [],
        "usage": {"prompt_tokens": prompt_len, "completion_tokens": 6, "total_tokens": prompt_len + 6,
                  "prompt_tokens_details": {"cached_tokens": prompt_len // 2}},
    }


def test_chat_return_token_ids(serving: OpenAIServing, engine: FakeEngine) -> None:
    """The rendered conversation's ids on the response, each choice's
    generated ids on it; streamed, the prompt's on the first chunk (a
    role) and each chunk's own ids, which add up to the whole response's."""
    whole = chat(serving, n=2, max_tokens=3, return_token_ids=True)
    prompt_ids = engine.requests[0].prompt_token_ids
    assert whole.prompt_token_ids == prompt_ids
    assert [c.token_ids for c in whole.choices] == [engine.gen[j][:3] for j in (0, 1)]
    req = chat_req(n=2, max_tokens=3, stream=True, return_token_ids=True)
    chunks = parse_events(stream_events(serving, "chatcmpl-s", req))
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    ids: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[2:]:
        ids[c["choices"][0]["index"]] += c["choices"][0]["token_ids"]
    assert ids == {j: engine.gen[j][:3] for j in (0, 1)}
    assert not {"prompt_token_ids", "token_ids"} & set(chat(serving).model_dump(mode="json")["choices"][0])


def test_chat_logprobs(serving: OpenAIServing, engine: FakeEngine) -> None:
    response = chat(serving, max_tokens=2, logprobs=True, top_logprobs=2)
    assert engine.requests[0].sampling_params.logprobs == 2
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = [entry.model_dump() for entry in logprobs.content]
    tokens = [engine.decode([t]) for t in engine.gen[0][:2]]
    alts = [engine.decode([t]) for t in engine.alt]

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    assert content == [
        {**entry(tokens[0], CHOSEN_LOGPROB), "top_logprobs": [entry(tokens[0], CHOSEN_LOGPROB), entry(alts[0], -3.0)]},
        # The chosen token ranks third: the top 2 are the others.
        {**entry(tokens[1], UNLIKELY_LOGPROB), "top_logprobs": [entry(alts[0], -1.5), entry(alts[1], -2.5)]},
    ]
    plain = chat(serving, "c2", max_tokens=2, logprobs=True)
    assert engine.requests[1].sampling_params.logprobs == 0
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content is not None
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], []]


# ---- errors ------------------------------------------------------------------------------------


def raised(coro: Any) -> BaseException:
    try:
        asyncio.run(coro)
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        return e
    raise AssertionError("expected an exception")


@pytest.mark.parametrize("stream", [False, True])
def test_bad_params_are_400s_naming_the_field_before_any_stream(serving: OpenAIServing, stream: bool) -> None:
    cases: list[tuple[Any, str]] = [
        (completion_req(prompt="hi", temperature=-1, stream=stream), "temperature"),
        (completion_req(prompt="hi", max_tokens=1000, stream=stream), "max_tokens"),
        (completion_req(prompt=[], stream=stream), "prompt"),
        (completion_req(prompt=[[1], []], stream=stream), "prompt"),
        (completion_req(prompt="hi", logprobs=50, stream=stream), "logprobs"),
    ]
    chat_cases: list[tuple[Any, str]] = [
        (chat_req(max_completion_tokens=1000, stream=stream), "max_completion_tokens"),
        (chat_req(logprobs=True, top_logprobs=50, stream=stream), "top_logprobs"),
        (chat_req(messages=[], stream=stream), "messages"),
        (chat_req(continue_final_message=True, stream=stream), "continue_final_message"),
    ]
    for req, param in cases:
        exc = raised(serving.create_completion(req, "r"))
        assert isinstance(exc, InvalidParameterError) and exc.param == param, (req, exc)
        status, body = error_body(exc)
        assert status == 400 and body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    for req, param in chat_cases:
        exc = raised(serving.create_chat_completion(req, "r"))
        assert isinstance(exc, InvalidParameterError) and exc.param == param, (req, exc)


def test_prompt_too_long_is_400_before_the_stream(serving: OpenAIServing, engine: FakeEngine) -> None:
    long_prompt = [5] * MAX_MODEL_LEN
    req = completion_req(prompt=[[5, 6], long_prompt], stream=True)
    exc = raised(serving.create_completion(req, "r"))
    assert isinstance(exc, PromptTooLongError) and error_body(exc)[0] == 400
    # The valid sibling prompt's stream was started, then closed (aborted).
    assert engine.aborted == ["r-0"]


def test_unknown_model_is_404(serving: OpenAIServing, engine: FakeEngine) -> None:
    for coro in (
        serving.create_completion(completion_req(model="gpt-4", prompt="hi", stream=True), "r"),
        serving.create_chat_completion(chat_req(model="gpt-4"), "r"),
    ):
        exc = raised(coro)
        assert isinstance(exc, ModelNotFoundError)
        status, body = error_body(exc)
        assert status == 404 and body["error"]["type"] == "not_found_error"
    with pytest.raises(ModelNotFoundError):
        asyncio.run(serving.tokenize(TokenizeCompletionRequest(model="gpt-4", prompt="x")))
    assert engine.requests == []


def test_engine_error_mid_stream_becomes_an_error_event(serving: OpenAIServing, engine: FakeEngine) -> None:
    engine.fail_after_steps = 1
    req = completion_req(prompt="hello", max_tokens=3, stream=True)
    events = stream_events(serving, "r", req)
    payloads = parse_events(events)
    assert payloads[0]["choices"][0]["text"] == expected_text(engine, 0, 1)
    assert payloads[-1] == {
        "error": {
            "message": "the engine is not available; retry later", "type": "service_unavailable", "param": None,
            "code": 503,
        }
    }
    chat_payloads = parse_events(stream_events(serving, "c", chat_req(stream=True)))
    assert chat_payloads[-1]["error"]["code"] == 503
    # Without a stream the error propagates for the HTTP layer to map.
    assert isinstance(raised(serving.create_completion(CompletionRequest(prompt="hi"), "x")), EngineDeadError)


# ---- the client going away ------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["hello", ["hello", "the cat"]])
def test_closing_a_stream_early_aborts_the_engine_requests(
    serving: OpenAIServing, engine: FakeEngine, prompt: Any
) -> None:
    async def run() -> str:
        req = completion_req(prompt=prompt, max_tokens=3, n=2, stream=True)
        stream = await serving.create_completion(req, "r")
        assert isinstance(stream, EventStream)
        first = await stream.__anext__()
        await stream.aclose()
        return first

    first = asyncio.run(run())
    assert first.startswith("data: {")
    expected = ["r"] if isinstance(prompt, str) else ["r-0", "r-1"]
    assert sorted(engine.aborted) == expected and engine.finished == []


def test_a_streaming_response_starts_before_the_first_token(serving: OpenAIServing, engine: FakeEngine) -> None:
    """Eager admission: `create_completion` returns the event stream (the
    HTTP layer sends 200 and the headers) while the engine has produced no
    output yet; the request is already admitted, and invalid input still
    raises before any stream exists."""

    async def run() -> list[str]:
        engine.gate = asyncio.Event()
        stream = await serving.create_completion(completion_req(prompt="hi", max_tokens=2, stream=True), "r")
        assert isinstance(stream, EventStream)
        assert [r.request_id for r in engine.requests] == ["r"]
        with pytest.raises(InvalidParameterError, match="temperature"):
            await serving.create_completion(completion_req(prompt="hi", temperature=-1.0, stream=True), "bad")
        engine.gate.set()
        return [event async for event in stream]

    events = asyncio.run(run())
    assert events[-1] == SSE_DONE and len(parse_events(events)) >= 2
    assert engine.finished == ["r"] and engine.aborted == []


def test_a_stream_never_iterated_still_aborts_on_close(serving: OpenAIServing, engine: FakeEngine) -> None:
    async def run() -> None:
        req = chat_req(stream=True)
        stream = await serving.create_chat_completion(req, "r")
        assert isinstance(stream, EventStream)
        await stream.aclose()

    asyncio.run(run())
    assert engine.aborted == ["r"]


def test_cancelling_a_whole_response_aborts(serving: OpenAIServing, engine: FakeEngine) -> None:
    async def run() -> None:
        engine.held = asyncio.Queue()
        req = completion_req(prompt=["hello", "the cat"], max_tokens=3)
        task = asyncio.create_task(serving.create_completion(req, "r"))
        # Both requests have sent their first output and are mid-generation.
        assert sorted([await engine.held.get(), await engine.held.get()]) == ["r-0", "r-1"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert sorted(engine.aborted) == ["r-0", "r-1"] and engine.finished == []


# ---- /v1/models, /tokenize, /detokenize --------------------------------------------------------------


def test_show_models(serving: OpenAIServing) -> None:
    body = serving.show_models().model_dump()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        (MODEL, "model", "rayvllm", MAX_MODEL_LEN),
        ("alias", "model", "rayvllm", MAX_MODEL_LEN),
    ]
    assert all(isinstance(m["created"], int) and m["root"] for m in body["data"])


def test_tokenize_and_detokenize(serving: OpenAIServing, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("hello world")
    response = asyncio.run(serving.tokenize(TokenizeCompletionRequest(model=MODEL, prompt="hello world")))
    assert response.model_dump() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    chat_response = asyncio.run(serving.tokenize(TokenizeChatRequest.model_validate({"messages": MESSAGES})))
    rendered = engine.processor.render_chat(MESSAGES)
    assert chat_response.tokens == engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert serving.detokenize(DetokenizeRequest(tokens=ids)).prompt == engine.decode(ids)
    with pytest.raises(InvalidParameterError) as exc:
        serving.detokenize(DetokenizeRequest(model=MODEL, tokens=[1, 10**6]))
    assert exc.value.param == "tokens"
