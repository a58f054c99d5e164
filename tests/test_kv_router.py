"""KV-aware routing across Serve replicas: the engine's block events (the
core tells its client which blocks it begins and stops caching), the
replica's report built from them, and two replicas behind
`KVAwareRequestRouter` where every follow-up to a prompt lands on the
replica holding it (its exact cached token count says so)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from rayvllm import SamplingParams
from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.core.block_events import BlockEventLog
from rayvllm.core.replica_router import decode_report
from rayvllm.messages.block_hash import hash_request_tokens, routing_key
from rayvllm.messages.outputs import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _h(n: int) -> bytes:
    return bytes([n]) * 32


def test_block_events_report_each_key_once_across_ranks() -> None:
    log = BlockEventLog(num_ranks=2)
    first = log.drain()
    assert (first.stored, first.evicted, first.reset) == ([], [], True)
    log.cached(0, _h(1))
    log.cached(1, _h(1))  # another rank: no new event
    log.cached(1, _h(2))
    log.evicted(1, _h(2))  # stored and evicted within one push: nothing to tell
    events = log.drain()
    assert (events.stored, events.evicted, events.reset) == ([routing_key(_h(1))], [], False)
    log.evicted(0, _h(1))
    assert log.drain().evicted == []  # rank 1 still holds it
    log.clear_rank(1)  # rank 1's pool replaced by an empty one
    assert log.drain().evicted == [routing_key(_h(1))]


def test_an_engines_report_names_exactly_the_blocks_it_caches(tiny_model_dir: Path) -> None:
    """Through the engine loop and its client: after a 40-token prompt the
    report holds its two full 16-token blocks' keys, and the load."""
    prompt = [random.Random(3).randrange(5, 4000) for _ in range(40)]

    async def main() -> dict:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20)
        )
        try:
            async for _ in engine.generate({"prompt_token_ids": prompt}, GREEDY, "r",
                                           output_kind=RequestOutputKind.FINAL_ONLY):
                pass
            return engine.routing_report()
        finally:
            engine.shutdown()

    load, keys = decode_report(asyncio.run(main()))
    # 44 tokens were computed (prompt and outputs but the last): two full blocks of the prompt.
    expected = [routing_key(h) for h in hash_request_tokens(16, (prompt + [0] * 4)[:32])]
    assert sorted(keys) == sorted(expected[:2]) and load.num_running == 0 and load.num_queued_tokens == 0


ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402

from rayvllm.entrypoints.serve_builder import build_app  # noqa: E402


@pytest.fixture(scope="module")
def two_replicas(serve_local: None, tiny_model_dir: Path) -> Iterator[serve.handle.DeploymentHandle]:
    args = dict(model=str(tiny_model_dir), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20,
                num_replicas=2)
    try:
        yield serve.run(build_app(args), name="kvr", route_prefix=None)
    finally:
        serve.delete("kvr")


def test_every_follow_up_lands_on_the_replica_holding_its_prefix(two_replicas: serve.handle.DeploymentHandle) -> None:
    """Six 64-token documents, each sent once and then with a 9-token tail:
    each follow-up is served from its document's four cached blocks (a
    router blind to the cache would miss half of them)."""
    rng = random.Random(11)
    for _ in range(6):
        doc = [rng.randrange(5, 4000) for _ in range(64)]
        first = two_replicas.generate.remote({"prompt_token_ids": doc}, GREEDY).result()
        assert first.num_cached_tokens == 0
        again = two_replicas.generate.remote({"prompt_token_ids": doc + list(range(9, 18))}, GREEDY).result()
        assert again.num_cached_tokens == 64
