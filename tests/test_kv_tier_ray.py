"""The Ray object store tier: its directory's bounds, a prefix computed by
one DP rank loaded by the other, by a second engine (a stand-in for a
second Serve replica, in its own process), and objects lost between
look-up and load recomputed with identical tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray

from hf_oracle import hf_greedy
from rayvllm import LLM, SamplingParams
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.engine_core import EngineCore
from rayvllm.executor.uniproc import UniProcExecutor
from rayvllm.kv_offload.ray_tier import KV_TIER_NAMESPACE, KVTierDirectoryActor, directory_name
from rayvllm.messages.block_hash import hash_request_tokens
from rayvllm.messages.engine_types import KVOffloadStats, ModelRunnerOutput
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.scheduler_output import SchedulerOutput

BLOCK = 16
NUM_NEW = 6
ENGINE = dict(
    dtype="float32", max_model_len=128, max_num_seqs=2, num_gpu_blocks_override=13,
    kv_offloading_size=1 / 1024, kv_offloading_backend="ray",
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture()
def fingerprint(ray_local: None, tiny_model_dir: Path) -> Iterator[str]:
    """The tiny model's tier; its (detached) directory is killed after the test."""
    oc = EngineArgs(model=str(tiny_model_dir), **ENGINE).create_engine_config().kv_offload_config
    assert oc is not None
    yield oc.fingerprint
    try:
        ray.kill(ray.get_actor(directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE))
    except ValueError:
        pass  # never created


def _docs(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(4 * BLOCK)] for _ in range(n)]


DOC, *OTHERS = _docs(4, seed=21)


def _request(req_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, tokens, PARAMS, eos_token_id=None)


def _run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_directory_is_an_lru_bounded_in_bytes(ray_local: None) -> None:
    directory = KVTierDirectoryActor.remote(capacity_bytes=4 * 8, num_shards=2)
    hashes = [bytes([i]) * 32 for i in range(3)]

    def put(block_hash: bytes, shard: int) -> tuple[bytes, int, np.ndarray]:
        return (block_hash, shard, np.full(8, shard, dtype=np.uint8))

    ray.get(directory.register.remote([put(hashes[0], 0), put(hashes[0], 1), put(hashes[1], 0)]))
    # Hash 1 has one of its two shards: not a hit yet.
    assert ray.get(directory.lookup.remote(hashes)) == 1
    ray.get(directory.register.remote([put(hashes[1], 1)]))
    assert ray.get(directory.lookup.remote(hashes)) == 2
    (ref,), missing = ray.get(directory.get_refs.remote([hashes[1], hashes[2]], 1))
    assert missing == [] and list(ray.get(ref)) == [1] * 8
    # 40 bytes > 32: the least recently used entry (hash 0: the look-ups touched 1 after it) goes.
    ray.get(directory.register.remote([put(hashes[2], 0)]))
    assert ray.get(directory.stats.remote()) == {"blocks": 2, "bytes": 24, "evictions": 1}
    assert ray.get(directory.lookup.remote(hashes)) == 0
    ray.kill(directory)


def _dp_core(tiny_model_dir: Path) -> EngineCore:
    """Two DP ranks with in-process runners: their only common ground is
    the Ray tier (each has its own pool and worker)."""
    config = EngineArgs(model=str(tiny_model_dir), data_parallel_size=2, **ENGINE).create_engine_config()
    return EngineCore(config, lambda rank: UniProcExecutor(config))


def _evict_doc_from_rank_0(core: EngineCore) -> None:
    core.add_request(_request("doc", DOC + [7, 8, 9]))
    _run(core)
    for i, other in enumerate(OTHERS):  # one at a time: idle ranks tie, rank 0 takes each
        core.add_request(_request(f"other{i}", other + [7]))
        assert core.request_rank[f"other{i}"] == 0
        _run(core)
    assert core.prefix_index is not None
    assert core.prefix_index.longest_prefix_hits(hash_request_tokens(BLOCK, DOC)) == [0, 0]


def _again_on_rank_1(core: EngineCore) -> tuple[dict[str, list[int]], KVOffloadStats | None]:
    """The document again, sent to rank 1 (rank 0 is kept busy); its tokens
    and rank 1's tier counters meanwhile."""
    core.add_request(_request("busy", _docs(1, seed=99)[0]))
    core.add_request(_request("again", DOC + [10, 11]))
    assert core.request_rank["again"] == 1
    rank1 = core.schedulers[1].kv_cache_manager
    rank1.make_offload_stats()
    tokens = _run(core)
    return tokens, rank1.make_offload_stats()


def test_a_prefix_rank_0_computed_is_loaded_by_rank_1(fingerprint: str, tiny_model_dir: Path) -> None:
    core = _dp_core(tiny_model_dir)
    try:
        _evict_doc_from_rank_0(core)
        tokens, offload = _again_on_rank_1(core)
        assert offload is not None and (offload.hits, offload.load_failures) == (4 * BLOCK, 0)
        assert tokens["again"] == hf_greedy(tiny_model_dir, DOC + [10, 11])[0][:NUM_NEW]
    finally:
        core.shutdown()


def test_lost_objects_are_recomputed_with_identical_tokens(fingerprint: str, tiny_model_dir: Path) -> None:
    """The directory (the objects' owner) dies after rank 1 found the
    prefix in it and before rank 1's step copies it in: the blocks are
    recomputed, and the tokens are those of transformers."""
    core = _dp_core(tiny_model_dir)
    try:
        _evict_doc_from_rank_0(core)
        directory = ray.get_actor(directory_name(fingerprint), namespace=KV_TIER_NAMESPACE)
        assert ray.get(directory.lookup.remote(hash_request_tokens(BLOCK, DOC))) == 4
        executor = core.executors[1]
        run_step = executor.execute_model

        def lose_tier_then_step(so: SchedulerOutput) -> ModelRunnerOutput:
            if so.kv_transfers is not None and so.kv_transfers.loads:
                ray.kill(directory)
            return run_step(so)

        executor.execute_model = lose_tier_then_step  # type: ignore[method-assign]
        tokens, offload = _again_on_rank_1(core)
        assert offload is not None and (offload.hits, offload.load_failures) == (0, 4)
        assert tokens["again"] == hf_greedy(tiny_model_dir, DOC + [10, 11])[0][:NUM_NEW]
    finally:
        core.shutdown()


def test_a_second_engine_loads_what_the_first_computed(fingerprint: str, tiny_model_dir: Path) -> None:
    """Two engines on Ray, each with its own SchedulerActor process (as two
    Serve replicas have): the second never computes the document's prefix,
    and loads it after the first, which made the directory and stored the
    blocks, is gone with its placement group."""
    first = LLM(model=str(tiny_model_dir), **ENGINE)
    try:
        for prompt in [DOC + [7, 8, 9]] + [other + [7] for other in OTHERS]:
            first.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    finally:
        first.shutdown()
    second = LLM(model=str(tiny_model_dir), **ENGINE)
    try:
        core = second.llm_engine.engine_core
        core.make_stats()
        (out,) = second.generate({"prompt_token_ids": DOC + [10, 11]}, PARAMS, use_tqdm=False)
        offload = core.make_stats().kv_offload_stats
        assert offload is not None and offload.tier == "ray"
        assert (offload.hits, offload.load_failures) == (4 * BLOCK, 0)
        assert out.num_cached_tokens == 4 * BLOCK
        assert out.outputs[0].token_ids == hf_greedy(tiny_model_dir, DOC + [10, 11])[0][:NUM_NEW]
    finally:
        second.shutdown()


@pytest.mark.parametrize("backend", ["native", "ray"])
def test_tensor_parallel_ranks_store_and_load_their_own_shards(
    fingerprint: str, tiny_model_dir: Path, backend: str
) -> None:
    """TP 2 (two WorkerActors): each rank stores its half of every evicted
    block (in its own memory, or as its own object, a block counting as
    held once both halves are in), and the reload gives transformers' tokens."""
    tp_args = dict(ENGINE, tensor_parallel_size=2, kv_offloading_backend=backend)
    oc = EngineArgs(model=str(tiny_model_dir), **tp_args).create_engine_config().kv_offload_config
    assert oc is not None and oc.fingerprint != fingerprint  # another layout, another directory
    llm = LLM(model=str(tiny_model_dir), **tp_args)
    try:
        for prompt in [DOC + [7, 8, 9]] + [other + [7] for other in OTHERS]:
            llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
        if backend == "ray":
            directory = ray.get_actor(directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE)
            assert ray.get(directory.lookup.remote(hash_request_tokens(BLOCK, DOC))) == 4
        core = llm.llm_engine.engine_core
        core.make_stats()
        (out,) = llm.generate({"prompt_token_ids": DOC + [10, 11]}, PARAMS, use_tqdm=False)
        offload = core.make_stats().kv_offload_stats
        assert offload is not None and (offload.hits, offload.load_failures) == (4 * BLOCK, 0)
        assert out.outputs[0].token_ids == hf_greedy(tiny_model_dir, DOC + [10, 11])[0][:NUM_NEW]
    finally:
        llm.shutdown()
        if backend == "ray":
            ray.kill(ray.get_actor(directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE))
