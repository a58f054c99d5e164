"""Hostile input (issue 16): every request a client can send either runs or
gets an OpenAI-style 4xx naming the field, before any token, and the engine
keeps stepping for everyone else.

The requests go through the real OpenAI layer (`parse_request`, then
`OpenAIServing`) into a real in-process `AsyncLLM` on the tiny random
model: named cases first, then property-based fuzzing of both generation
routes with hypothesis. After each group the engine must still serve a
request and hold no request and no KV block.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayvllm.actors.factory import async_llm_from_engine_args

from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    error_body,
    parse_request,
    parse_tokenize_request,
)
from rayvllm.entrypoints.openai.serving import OpenAIServing
from rayvllm.messages.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRINGS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

MAX_NUM_SEQS = 8
ENGINE = dict(max_num_seqs=MAX_NUM_SEQS, max_model_len=128, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=128)
VOCAB = 4096  # RandomModelSpec's default


class Server:
    """One engine and its OpenAI layer on a private event loop; `call` runs
    one request to completion and returns (HTTP status, body)."""

    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine: AsyncLLM = self.loop.run_until_complete(self._start(model_dir))
        self.serving = OpenAIServing(self.engine, [self.engine.served_model_name], self.engine.max_model_len)

    @staticmethod
    async def _start(model_dir: Path) -> AsyncLLM:
        return async_llm_from_engine_args(EngineArgs(model=str(model_dir), **ENGINE))

    def call(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.loop.run_until_complete(self._call(route, body))

    async def _call(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            if route == "tokenize":
                return 200, (await self.serving.tokenize(parse_tokenize_request(body))).model_dump(mode="json")
            if route == "detokenize":
                return 200, self.serving.detokenize(parse_request(DetokenizeRequest, body)).model_dump(mode="json")
            if route == "chat":
                result = await self.serving.create_chat_completion(parse_request(ChatCompletionRequest, body), "chatcmpl-t")
            else:
                result = await self.serving.create_completion(parse_request(CompletionRequest, body), "cmpl-t")
            if hasattr(result, "model_dump"):
                return 200, result.model_dump(mode="json")
            return 200, [chunk async for chunk in result]
        except Exception as e:  # noqa: BLE001 - what the route handlers turn into responses
            return error_body(e)

    def assert_healthy_and_idle(self) -> None:
        status, body = self.call("completions", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert status == 200 and len(body["choices"]) == 1, body
        stats = self.engine.engine_core.make_stats()
        assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)

    def close(self) -> None:
        self.engine.shutdown()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[Server]:
    s = Server(tiny_model_dir)
    try:
        yield s
    finally:
        s.close()


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


# (case, route, body, the param the 400 names)
BAD_REQUESTS: list[tuple[str, str, dict[str, Any], str]] = [
    ("seed over 64 bits", "completions", _completion(seed=2**64, temperature=1.0), "seed"),
    ("seed below int64", "completions", _completion(seed=SEED_MIN - 1, temperature=1.0), "seed"),
    ("temperature inf", "completions", _completion(temperature=math.inf), "temperature"),
    ("temperature nan", "completions", _completion(temperature=math.nan), "temperature"),
    ("temperature negative", "completions", _completion(temperature=-1.0), "temperature"),
    ("repetition_penalty inf", "completions", _completion(repetition_penalty=math.inf), "repetition_penalty"),
    ("repetition_penalty 0", "completions", _completion(repetition_penalty=0.0), "repetition_penalty"),
    ("frequency_penalty nan", "completions", _completion(frequency_penalty=math.nan), "frequency_penalty"),
    ("presence_penalty -inf", "completions", _completion(presence_penalty=-math.inf), "presence_penalty"),
    ("top_p 0", "completions", _completion(top_p=0.0), "top_p"),
    ("top_p over 1", "completions", _completion(top_p=1.5), "top_p"),
    ("min_p nan", "completions", _completion(min_p=math.nan), "min_p"),
    ("top_k -2", "completions", _completion(top_k=-2), "top_k"),
    ("max_tokens 0", "completions", _completion(max_tokens=0), "max_tokens"),
    ("max_tokens negative", "completions", _completion(max_tokens=-3), "max_tokens"),
    ("max_tokens over the context", "completions", _completion(max_tokens=10**30), "max_tokens"),
    ("n of a million", "completions", _completion(n=10**6), "n"),
    ("n 0", "completions", _completion(n=0), "n"),
    ("best_of above n", "completions", _completion(best_of=5), "best_of"),
    ("empty prompt", "completions", _completion(prompt=""), "prompt"),
    ("empty token list", "completions", _completion(prompt=[]), "prompt"),
    ("a prompt of a million tokens", "completions", _completion(prompt="a " * 500_000), "prompt"),
    ("a million token ids", "completions", _completion(prompt=[7] * 1_000_000), "prompt"),
    ("token id past the vocabulary", "completions", _completion(prompt=[VOCAB]), "prompt"),
    ("token id of 70 bits", "completions", _completion(prompt=[2**70]), "prompt"),
    ("negative token id", "completions", _completion(prompt=[-1]), "prompt"),
    ("hundreds of stop strings", "completions", _completion(stop=[f"s{i}" for i in range(300)]), "stop"),
    ("a huge stop string", "completions", _completion(stop=["x" * 100_000]), "stop"),
    ("empty stop string", "completions", _completion(stop=[""]), "stop"),
    ("stop token id past the vocabulary", "completions", _completion(stop_token_ids=[2**70]), "stop_token_ids"),
    ("logit_bias key not a number", "completions", _completion(logit_bias={"abc": 1}), "logit_bias"),
    ("logit_bias id past the vocabulary", "completions", _completion(logit_bias={"99999999999999999999": 1}), "logit_bias"),
    ("logit_bias value nan", "completions", _completion(logit_bias={"5": math.nan}), "logit_bias"),
    ("logit_bias value 1000", "completions", _completion(logit_bias={"5": 1000}), "logit_bias"),
    (
        "logit_bias with too many entries", "completions",
        _completion(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), "logit_bias",
    ),
    ("logprobs of a billion", "completions", _completion(logprobs=10**9), "logprobs"),
    ("prompt_logprobs of a billion", "completions", _completion(prompt_logprobs=10**9), "prompt_logprobs"),
    ("min_tokens over max_tokens", "completions", _completion(min_tokens=10**9), "min_tokens"),
    ("wrong type", "completions", _completion(temperature="hot"), "temperature"),
    ("missing prompt", "completions", {"max_tokens": 2}, "prompt"),
    ("prompt of the wrong shape", "completions", _completion(prompt={"text": "hi"}), "prompt"),
    ("missing messages", "chat", {"max_tokens": 2}, "messages"),
    ("empty messages", "chat", {"messages": [], "max_tokens": 2}, "messages"),
    ("message without a role", "chat", {"messages": [{"content": "hi"}], "max_tokens": 2}, "messages.0.role"),
    (
        "template reaching Python internals", "chat",
        {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ ''.__class__.__mro__ }}"}, "chat_template",
    ),
    ("chat seed over 64 bits", "chat", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
]


@pytest.mark.parametrize("case,route,body,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_named_bad_request_is_a_400_naming_the_field(server: Server, case: str, route: str, body: dict, param: str) -> None:
    status, reply = server.call(route, body)
    assert status == 400, (case, reply)
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param, reply
    assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]


def test_engine_serves_after_the_named_cases(server: Server) -> None:
    for _case, route, body, _param in BAD_REQUESTS:
        server.call(route, body)
    server.assert_healthy_and_idle()


def test_trusted_request_templates_still_render_sandboxed(server: Server) -> None:
    """With the operator option on, a request's template runs, but in
    jinja's sandbox: reaching Python internals is a 400, not code execution."""
    trusting = OpenAIServing(
        server.engine, [server.engine.served_model_name], server.engine.max_model_len, trust_request_chat_template=True
    )
    messages = [{"role": "user", "content": "hi"}]

    async def render(template: str) -> tuple[int, Any]:
        body = {"messages": messages, "max_tokens": 2, "temperature": 0, "chat_template": template}
        try:
            result = await trusting.create_chat_completion(parse_request(ChatCompletionRequest, body), "chatcmpl-t")
            return 200, result.model_dump(mode="json")
        except Exception as e:  # noqa: BLE001
            return error_body(e)

    try:
        status, reply = server.loop.run_until_complete(render("{{ ''.__class__.__mro__[1].__subclasses__() }}"))
        assert status == 400 and reply["error"]["param"] == "messages" and "unsafe" in reply["error"]["message"]
        status, reply = server.loop.run_until_complete(render(ECHO_TEMPLATE))
        assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    finally:
        trusting.close()


ECHO_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_trusted_request_templates_are_bounded(server: Server) -> None:
    """A request's template that loops for ages or builds gigabytes is
    stopped (its child process killed) and answered with a 400 naming
    chat_template; the next template renders in a fresh child, and the
    event loop, the engine and the server's own template never wait on it."""
    trusting = OpenAIServing(
        server.engine, [server.engine.served_model_name], server.engine.max_model_len, trust_request_chat_template=True
    )
    assert trusting._client_templates is not None
    trusting._client_templates.timeout_s = 2.0
    trusting._client_templates.memory_bytes = 256 << 20
    messages = [{"role": "user", "content": "hi"}]

    async def tokenize(template: str) -> tuple[int, Any]:
        body = {"messages": messages, "chat_template": template}
        try:
            return 200, (await trusting.tokenize(parse_tokenize_request(body))).model_dump(mode="json")
        except Exception as e:  # noqa: BLE001
            return error_body(e)

    async def while_a_template_hangs() -> tuple[tuple[int, Any], int]:
        hang = asyncio.create_task(tokenize(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        ))
        renderer = trusting._client_templates
        assert renderer is not None
        while not renderer._lock.locked():
            await asyncio.sleep(0)  # a turn of the loop: the task takes the child
        # The event loop is free meanwhile: the server's own template renders.
        own = await trusting.tokenize(parse_tokenize_request({"messages": messages}))
        assert not hang.done()
        return await hang, own.count

    try:
        (status, reply), own_count = server.loop.run_until_complete(while_a_template_hangs())
        assert own_count > 0
        assert status == 400 and reply["error"]["param"] == "chat_template" and "longer than" in reply["error"]["message"]
        status, reply = server.loop.run_until_complete(tokenize("{{ 'x' * 1000000000 }}"))
        assert status == 400 and reply["error"]["param"] in ("chat_template", "messages"), reply
        status, reply = server.loop.run_until_complete(tokenize(ECHO_TEMPLATE))
        assert status == 200 and reply["count"] > 0
    finally:
        trusting.close()
    server.assert_healthy_and_idle()


@pytest.mark.parametrize("seed", [SEED_MIN, -1, 0, SEED_MAX])
def test_every_int64_seed_samples_and_reproduces(server: Server, seed: int) -> None:
    """The edges of the range run, with n > 1 (children take seed + i,
    wrapping past the largest), and the same seed gives the same tokens."""
    body = {"prompt": [9, 10, 11], "max_tokens": 4, "temperature": 1.0, "seed": seed, "n": 2, "ignore_eos": True}
    first = server.call("completions", body)
    again = server.call("completions", body)
    assert first[0] == 200 and again[0] == 200
    assert [c["text"] for c in first[1]["choices"]] == [c["text"] for c in again[1]["choices"]]


def test_sampling_params_refuse_what_the_engine_cannot_hold() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=SEED_MAX + 1)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=True)  # a bool is not a count
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}


# ---- property-based fuzzing ------------------------------------------------------

_ints = st.one_of(st.integers(-3, 300), st.integers(min_value=-(2**80), max_value=2**80))
_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3))
_junk = st.one_of(st.none(), st.booleans(), _ints, _floats, st.text(max_size=8), st.lists(st.integers(-2, 5), max_size=3))
_token_ids = st.lists(st.integers(-5, VOCAB + 5), max_size=40)
_prompt = st.one_of(
    st.text(max_size=200),
    _token_ids,
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(_token_ids, max_size=3),
    _junk,
)
_sampling = {
    "temperature": st.one_of(_floats, _junk),
    "top_p": st.one_of(_floats, _junk),
    "top_k": st.one_of(_ints, _junk),
    "min_p": _floats,
    "presence_penalty": _floats,
    "frequency_penalty": _floats,
    "repetition_penalty": _floats,
    "seed": st.one_of(_ints, _junk),
    "n": st.one_of(st.integers(-1, 3), _ints),
    "max_tokens": st.one_of(st.integers(-1, 4), _ints, _junk),
    "min_tokens": st.one_of(st.integers(-1, 3), _ints),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4), _junk),
    "stop_token_ids": st.one_of(st.lists(_ints, max_size=3), _junk),
    "logit_bias": st.one_of(st.dictionaries(st.text(max_size=6), _floats, max_size=3), _junk),
    "logprobs": st.one_of(st.integers(-1, 25), _junk),
    "prompt_logprobs": st.one_of(st.integers(-1, 25), _junk),
    "ignore_eos": st.one_of(st.booleans(), _junk),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "model": st.one_of(st.none(), st.text(max_size=6)),
}
_valid_sampling = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(SEED_MIN, SEED_MAX),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 4),
    "min_tokens": st.integers(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
    "logprobs": st.integers(0, 5),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
}
_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), _junk)},
    optional={"content": st.one_of(st.text(max_size=60), _junk, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2))},
)
_valid_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": st.text(min_size=1, max_size=40)})
_valid_prompt = st.one_of(st.text(min_size=1, max_size=100), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))


def _requests(required: dict[str, Any], hostile: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A third each: valid requests; valid ones with one or two fields
    replaced by hostile values; requests of hostile fields only."""
    valid = st.fixed_dictionaries(required, optional=_valid_sampling)
    perturbed = st.tuples(valid, st.dictionaries(st.sampled_from(sorted(hostile)), _junk, min_size=1, max_size=2))
    return st.one_of(
        valid,
        perturbed.map(lambda pair: {**pair[0], **pair[1]}),
        st.fixed_dictionaries({}, optional=hostile),
    )


COMPLETIONS = _requests(
    {"prompt": _valid_prompt}, {"prompt": _prompt, "echo": st.booleans(), "prompt_logprobs": st.integers(-1, 25), **_sampling}
)
CHATS = _requests(
    {"messages": st.lists(_valid_message, min_size=1, max_size=2)},
    {"messages": st.one_of(st.lists(_message, max_size=3), _junk), "max_completion_tokens": st.integers(-1, 4), **_sampling},
)
FUZZ = settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _check_reply(status: int, reply: Any) -> None:
    assert status < 500, reply
    if status != 200:
        assert status in (400, 404) and set(reply["error"]) >= {"message", "type", "param", "code"}, reply


@FUZZ
@given(body=COMPLETIONS)
def test_fuzzed_completions_never_5xx(server: Server, body: dict[str, Any]) -> None:
    _check_reply(*server.call("completions", _bounded(body)))


@FUZZ
@given(body=CHATS)
def test_fuzzed_chat_completions_never_5xx(server: Server, body: dict[str, Any]) -> None:
    _check_reply(*server.call("chat", _bounded(body)))


TOKENIZE = st.one_of(
    st.fixed_dictionaries({}, optional={"prompt": _prompt, "add_special_tokens": st.one_of(st.booleans(), _junk), "model": _junk}),
    st.fixed_dictionaries({}, optional={"messages": st.one_of(st.lists(_message, max_size=3), _junk), "model": _junk}),
)
DETOKENIZE = st.fixed_dictionaries({}, optional={"tokens": st.one_of(_token_ids, st.lists(_ints, max_size=4), _junk), "model": _junk})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(body=TOKENIZE, detokenize=DETOKENIZE)
def test_fuzzed_tokenize_and_detokenize_never_5xx(server: Server, body: dict[str, Any], detokenize: dict[str, Any]) -> None:
    _check_reply(*server.call("tokenize", body))
    _check_reply(*server.call("detokenize", detokenize))


# ---- the HTTP layer itself: raw bodies into the replica's route functions ----------

ROUTES = ("completions", "chat_completions", "tokenize", "detokenize")
_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), _ints, st.floats(-1e6, 1e6), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=12,
)
_RAW_BODIES = st.one_of(
    st.binary(max_size=300),  # anything at all, invalid UTF-8 included
    _json_values.map(lambda v: json.dumps(v).encode()),  # JSON, not necessarily an object
    st.sampled_from([
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
        b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",  # an integer past Python's digit limit
        b'{"prompt": "a", "max_tokens": 1e999}', b'{"prompt": NaN}', b'{"messages": Infinity}',
        b'{"prompt": "\ud800", "max_tokens": 1}', b"", b"null", b"\xef\xbb\xbf{}", b'{"a": 1}' * 2,
    ]),
    st.one_of(COMPLETIONS, CHATS).map(lambda body: json.dumps(_bounded(body), default=str).encode()),
)


class _Route:
    """The replica's own FastAPI route methods (LLMServer's class, Serve
    left out) called with real starlette Requests whose body arrives in
    chunks: what a client's bytes meet before and after parsing."""

    def __init__(self, server: Server) -> None:
        from rayvllm.entrypoints.openai.api_server import LLMServer
        from rayvllm.entrypoints.openai.server_args import ServerArgs

        self.server = server
        self.cls = LLMServer.func_or_class
        self.replica = object.__new__(self.cls)
        self.replica.serving, self.replica.max_request_bytes = server.serving, 1 << 20
        self.replica.access = ServerArgs().access()

    def call(self, route: str, body: bytes, chunk: int) -> tuple[int, bytes]:
        return self.server.loop.run_until_complete(self._call(route, body, chunk))

    async def _call(self, route: str, body: bytes, chunk: int) -> tuple[int, bytes]:
        from starlette.requests import Request

        parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
        messages = [{"type": "http.request", "body": p, "more_body": i + 1 < len(parts)} for i, p in enumerate(parts)]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": f"/{route}", "headers": [], "query_string": b""}
        response = await getattr(self.cls, route)(self.replica, Request(scope, receive))
        if hasattr(response, "body_iterator"):
            return response.status_code, b"".join([c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator])
        return response.status_code, response.body


def _check_http_reply(status: int, payload: bytes) -> None:
    assert status < 500, payload[:300]
    if status != 200:
        reply = json.loads(payload)
        assert status in (400, 404, 413) and set(reply["error"]) >= {"message", "type", "param", "code"}, reply


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=_RAW_BODIES, chunk=st.sampled_from([1, 7, 64, 1 << 20]))
def test_fuzzed_http_bodies_never_5xx(server: Server, route: str, body: bytes, chunk: int) -> None:
    """600 raw bodies per run over the four POST routes: a 200 or an
    OpenAI-style 4xx, never a 5xx (a body nested past the recursion limit
    and a 5,000-digit integer were 500s before)."""
    if len(body) > 4096 and chunk == 1:
        chunk = 4096  # the deep-nesting body in one-byte chunks would take minutes of test time
    _check_http_reply(*_Route(server).call(route, body, chunk))


def test_engine_serves_and_holds_nothing_after_fuzzing(server: Server) -> None:
    server.assert_healthy_and_idle()


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Keep accepted requests short so 2,000 of them run in seconds: only a
    small positive max_tokens is left as drawn (anything else is still sent
    as drawn when it is invalid)."""
    limit = body.get("max_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 4:
        body["max_tokens"] = 4
    if body.get("max_tokens") is None and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    return body
