"""Hostile input on /v1/responses and /v1/embeddings: whatever a client
sends either runs or gets an OpenAI-style 400/404 naming the field, and the
engine keeps serving, holding no request and no KV block afterwards.

The bodies go through the real OpenAI layer (`parse_request`, then the
serving classes) into real in-process `AsyncLLM`s on the tiny random model:
a generating one for responses, a pooling one for embeddings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayvllm.actors.factory import async_llm_from_engine_args

from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.entrypoints.openai.embedding_protocol import EmbeddingRequest
from rayvllm.entrypoints.openai.protocol import error_body, parse_request
from rayvllm.entrypoints.openai.responses_protocol import ResponsesRequest
from rayvllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from rayvllm.entrypoints.openai.serving_responses import OpenAIServingResponses

ENGINE = dict(max_num_seqs=8, max_model_len=128, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64)
VOCAB = 4096  # RandomModelSpec's default
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


class Engines:
    """Both engines and their OpenAI layers on one private event loop."""

    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.generate = self.loop.run_until_complete(self._start(model_dir, {}))
        self.pool = self.loop.run_until_complete(self._start(model_dir, {"runner": "pooling"}))
        names = lambda engine: ([engine.served_model_name], engine.max_model_len)  # noqa: E731
        self.responses = OpenAIServingResponses(self.generate, *names(self.generate))
        self.embeddings = OpenAIServingEmbedding(self.pool, *names(self.pool))

    @staticmethod
    async def _start(model_dir: Path, extra: dict[str, Any]) -> AsyncLLM:
        return async_llm_from_engine_args(EngineArgs(model=str(model_dir), **ENGINE, **extra))

    def call(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self.loop.run_until_complete(self._call(route, body))

    async def _call(self, route: str, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            if route == "embeddings":
                result: Any = await self.embeddings.create_embedding(parse_request(EmbeddingRequest, body), "embd-t")
            else:
                result = await self.responses.create_response(parse_request(ResponsesRequest, body), "resp_t")
            if hasattr(result, "model_dump"):
                return 200, result.model_dump(mode="json")
            return 200, [event async for event in result]
        except Exception as e:  # noqa: BLE001 - what the route handlers turn into responses
            return error_body(e)

    def assert_healthy_and_idle(self) -> None:
        status, body = self.call("responses", {"input": "hello", "max_output_tokens": 3, "temperature": 0})
        assert status == 200 and body["output"][0]["content"][0]["type"] == "output_text", body
        status, body = self.call("embeddings", {"input": [[5, 6, 7], [8, 9]]})
        assert status == 200 and len(body["data"]) == 2, body
        for engine in (self.generate, self.pool):
            stats = engine.engine_core.make_stats()
            assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)

    def close(self) -> None:
        self.generate.shutdown()
        self.pool.shutdown()
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[Engines]:
    e = Engines(tiny_model_dir)
    try:
        yield e
    finally:
        e.close()


_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5), st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_token_ids = st.lists(st.integers(-3, VOCAB + 3), max_size=8)
_part = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["input_text", "output_text", "input_image", "text"]), _junk)},
    optional={"text": st.one_of(st.text(max_size=20), _junk)},
)
_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.one_of(st.sampled_from(["message", "function_call_output", "item_reference"]), _junk),
        "role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), _junk),
        "content": st.one_of(st.text(max_size=40), st.lists(_part, max_size=3), _junk),
    },
)
RESPONSES = st.fixed_dictionaries(
    {},
    optional={
        "input": st.one_of(st.text(max_size=60), st.lists(_item, max_size=3), _junk),
        "instructions": st.one_of(st.text(max_size=20), _junk),
        "max_output_tokens": st.one_of(st.integers(-1, 4), _junk),
        "temperature": st.one_of(st.floats(-1, 3), _junk),
        "top_p": st.one_of(st.floats(-1, 2), _junk),
        "stream": st.booleans(),
        "store": st.one_of(st.booleans(), _junk),
        "previous_response_id": st.one_of(st.none(), st.text(max_size=5)),
        "tools": st.one_of(st.none(), st.just([]), _junk),
        "text": _junk,
        "model": st.one_of(st.none(), st.text(max_size=5)),
    },
)
EMBEDDINGS = st.fixed_dictionaries(
    {},
    optional={
        "input": st.one_of(st.text(max_size=60), st.lists(st.text(max_size=20), max_size=3), _token_ids,
                           st.lists(_token_ids, max_size=3), _junk),
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), _junk),
        "dimensions": st.one_of(st.none(), _junk),
        "normalize": st.one_of(st.none(), st.booleans(), _junk),
        "add_special_tokens": st.one_of(st.booleans(), _junk),
        "model": st.one_of(st.none(), st.text(max_size=5)),
    },
)


def _check_reply(status: int, reply: Any) -> None:
    assert status < 500, reply
    if status != 200:
        assert status in (400, 404) and set(reply["error"]) >= {"message", "type", "param", "code"}, reply


@FUZZ
@given(body=RESPONSES)
def test_fuzzed_responses_never_5xx(engines: Engines, body: dict[str, Any]) -> None:
    limit = body.get("max_output_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit > 4:
        body["max_output_tokens"] = 4  # accepted requests stay short; bad values are drawn below 1
    _check_reply(*engines.call("responses", body))


@FUZZ
@given(body=EMBEDDINGS)
def test_fuzzed_embeddings_never_5xx(engines: Engines, body: dict[str, Any]) -> None:
    _check_reply(*engines.call("embeddings", body))


def test_engines_serve_and_hold_nothing_after_fuzzing(engines: Engines) -> None:
    engines.assert_healthy_and_idle()
