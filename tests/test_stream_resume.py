"""A stream moved to another replica mid-way (stream_resume.py), on a real
engine: the events a server tags say exactly what its client has, and a
server given the `StreamResume` they add up to sends the rest of an
undisturbed run's events, under the same id: greedy, seeded, with a stop
string's held-back text, for completions and chat. The router ingress's
part, over real replicas killed mid-stream, is in test_kv_router.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.responses import StreamingResponse

from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.entrypoints.openai.forwarding import ForwardedChunk, ResponseHead, StreamPacer, response_parts
from rayvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from rayvllm.entrypoints.openai.serving import OpenAIServing
from rayvllm.entrypoints.openai.stream_resume import ProgressEvent, StreamResume
from rayvllm.entrypoints.openai.streams import EventStream
from rayvllm.messages.errors import InvalidParameterError

Served = tuple[OpenAIServing, asyncio.AbstractEventLoop]


@pytest.fixture(scope="module")
def serving(tiny_model_dir: Path) -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    args = EngineArgs(model=str(tiny_model_dir), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    engine: AsyncLLM = loop.run_until_complete(_async(async_llm_from_engine_args, args))
    yield OpenAIServing(engine, ["tiny"], 256), loop
    engine.shutdown()
    loop.close()


async def _async(fn: Any, *args: Any) -> Any:
    return fn(*args)  # built on the loop that will run it


def _run(served: Served, route: str, body: dict[str, Any], resume: StreamResume | None = None) -> EventStream:
    serving, loop = served
    if route == "chat":
        chat = parse_request(ChatCompletionRequest, {"model": "tiny", "stream": True, **body})
        return loop.run_until_complete(serving.create_chat_completion(chat, "chatcmpl-r", resume, tracked=True))
    req = parse_request(CompletionRequest, {"model": "tiny", "stream": True, **body})
    return loop.run_until_complete(serving.create_completion(req, "cmpl-r", resume, tracked=True))


def _events(served: Served, stream: EventStream) -> list[str]:
    async def drain() -> list[str]:
        return [event async for event in stream]

    return served[1].run_until_complete(drain())


def _chunks(events: list[str]) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in events if e.startswith("data: {")]


def _text(events: list[str]) -> str:
    out = ""
    for chunk in _chunks(events):
        for choice in chunk["choices"]:
            out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def _resume_after(opening: StreamResume, sent: list[str]) -> StreamResume:
    """What the router ingress holds once `sent` reached the client."""
    resume = StreamResume(opening.response_id, opening.created)
    for event in sent:
        if isinstance(event, ProgressEvent):
            resume.advance(event.token_ids, event.text_chars, event.num_cached_tokens, event.finished)
    return resume


PROMPT = "The history of the tiny model is"
CASES = {
    "greedy completion": ("completion", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}),
    "seeded completion": (
        "completion", {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    ),
    "greedy chat": (
        "chat", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20, "temperature": 0,
                 "ignore_eos": True}
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_stream_sends_the_rest_of_an_undisturbed_run(serving: Served, case: str) -> None:
    route, body = CASES[case]
    body = {**body, "stream_options": {"include_usage": True}}
    whole = _run(serving, route, body)
    assert whole.resume is not None
    events = _events(serving, whole)
    tagged = [e for e in events if isinstance(e, ProgressEvent)]
    # Every token is in exactly one tagged event, the usage and [DONE] are in
    # none; how many tokens an event carries depends on how far the engine ran
    # ahead of this reader (outputs a reader has not taken yet are merged).
    assert sum(len(e.token_ids) for e in tagged) == body["max_tokens"]
    assert [e.finished for e in tagged] == [False] * (len(tagged) - 1) + [True]
    last_unfinished = events.index(tagged[-1])
    usage = _chunks(events)[-1]["usage"]
    for cut in (1, len(events) // 2, last_unfinished):
        sent = events[:cut]
        resumed = _run(serving, route, body, _resume_after(whole.resume, sent))
        rest = _events(serving, resumed)
        assert _text(sent + rest) == _text(events), (case, cut)
        assert {c["id"] for c in _chunks(sent + rest)} == {whole.resume.response_id}
        assert {c["created"] for c in _chunks(sent + rest)} == {whole.resume.created}
        assert _chunks(rest)[-1]["usage"] == usage
        assert rest[-1] == "data: [DONE]\n\n"
        if route == "chat":  # the role opens the stream once
            roles = [c for c in _chunks(sent + rest) for ch in c["choices"] if ch["delta"].get("role")]
            assert len(roles) == 1


@pytest.mark.parametrize("case", ["greedy completion", "greedy chat"])
def test_gathered_chunks_carry_what_their_events_carry(serving: Served, case: str) -> None:
    """A stream as the router ingress gets it (response_parts, windows wide
    enough that chunks gather): the same text and usage as the stream read
    event by event, and the `StreamResume` folded from the gathered chunks
    equals the one folded from the events."""
    route, body = CASES[case]
    body = {**body, "max_tokens": 48, "stream_options": {"include_usage": True}}
    events = _events(serving, _run(serving, route, body))
    stream = _run(serving, route, body)
    assert stream.resume is not None
    wide = StreamPacer(min_interval_s=0.2, max_interval_s=0.2)

    async def forwarded() -> list[Any]:
        return [part async for part in response_parts(StreamingResponse(stream), wide)]

    head, *parts = serving[1].run_until_complete(forwarded())
    assert isinstance(head, ResponseHead) and head.body is None and head.resume is stream.resume
    gathered = "".join(p.data if isinstance(p, ForwardedChunk) else p for p in parts)
    sent = [e + "\n\n" for e in gathered.split("\n\n") if e]
    assert _text(sent) == _text(events)
    assert _chunks(sent)[-1]["usage"] == _chunks(events)[-1]["usage"]
    assert len(parts) < len(events)  # the windows gathered several events a message
    folded = StreamResume(head.resume.response_id, head.resume.created)
    for part in parts:
        if isinstance(part, ForwardedChunk):
            folded.advance(part.token_ids, part.text_chars, part.num_cached_tokens, part.finished)
    one_by_one = _resume_after(StreamResume(head.resume.response_id, head.resume.created), events)
    assert folded == one_by_one and len(folded.output_token_ids) == 48 and folded.finished


def test_text_not_yet_sent_is_sent_after_the_move(serving: Served) -> None:
    """Text the client was not sent yet (held back as a stop string's
    possible start, here by a stop string that never occurs whole) is sent
    by the new server: the resume point counts characters sent, not decoded."""
    greedy = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = _run(serving, "completion", greedy)
    events = _events(serving, whole)
    assert whole.resume is not None
    cut = next(i for i, e in enumerate(events) if isinstance(e, ProgressEvent) and len(_text(events[: i + 1])) > 4)
    sent = _text(events[: cut + 1])
    resume = _resume_after(whole.resume, events[: cut + 1])
    resume.text_chars -= 2  # the last two characters were held back
    body = {**greedy, "stop": [sent[-2:] + "\x00never"]}
    rest = _events(serving, _run(serving, "completion", body, resume))
    assert _text(rest).startswith(sent[-2:])
    assert sent[:-2] + _text(rest) == _text(events)


def test_streams_that_cannot_move_say_so(serving: Served) -> None:
    """Several choices, an echo or several prompts: no resume point is
    offered (another replica could not rebuild them), and one given is refused."""
    base = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    for body in ({**base, "n": 2}, {**base, "echo": True}, {**base, "prompt": [PROMPT, PROMPT]}):
        stream = _run(serving, "completion", body)
        assert stream.resume is None
        assert not any(isinstance(e, ProgressEvent) for e in _events(serving, stream))
        with pytest.raises(InvalidParameterError):
            _run(serving, "completion", body, StreamResume("cmpl-r", 0, [5], 1))


def test_a_stream_answered_directly_is_not_tracked(serving: Served) -> None:
    """A replica answering HTTP itself (nothing could resume its streams)
    does not tag their events."""
    serving_, loop = serving
    req = parse_request(CompletionRequest, {"model": "tiny", "stream": True, "prompt": PROMPT, "max_tokens": 4})
    stream = loop.run_until_complete(serving_.create_completion(req, "cmpl-d"))
    assert stream.resume is None
    assert not any(isinstance(e, ProgressEvent) for e in _events(serving, stream))

