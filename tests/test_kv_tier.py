"""The second KV tier without Ray: which hashes are stored when the pool
evicts, which blocks are loaded, LRU and byte bounds, failed loads, config
validation, and greedy parity with transformers with blocks loaded from
the host tier."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch

from hf_oracle import hf_greedy
from rayvllm import LLM, SamplingParams
from rayvllm.config.engine_args import EngineArgs
from rayvllm.core.kv_cache_manager import KVCacheManager
from rayvllm.core.request import Request
from rayvllm.entrypoints.cli import add_model_args, given_args
from rayvllm.kv_offload.block_io import KVBlockIO
from rayvllm.kv_offload.host_tier import HostKVStore, HostKVTier
from rayvllm.messages.block_hash import BlockHash, hash_request_tokens
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.kv_transfers import KVTransfers
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.sampling_params import SamplingParams as Params

BS = 4
PER_BLOCK = 100  # bytes of one block in these bookkeeping tests


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(EngineCoreRequest(req_id, tokens, Params(max_tokens=4), eos_token_id=None))


def _run(m: KVCacheManager, req: Request) -> list[int]:
    """Schedule a fresh request's whole prompt (lookup, allocate), as the scheduler does."""
    hits, num_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return m.get_block_ids(req.request_id)


def _h(tokens: list[int]) -> list[BlockHash]:
    return hash_request_tokens(BS, tokens)


A = list(range(100, 109))  # 9 tokens: two full blocks and one token
B = list(range(200, 216))  # 16 tokens: four full blocks


@pytest.fixture()
def manager() -> KVCacheManager:
    # 4 usable blocks; the tier holds 10 blocks' worth of bytes.
    return KVCacheManager(num_blocks=5, block_size=BS, kv_tier=HostKVTier(10 * PER_BLOCK + 50, PER_BLOCK))


def test_evicted_blocks_go_to_the_tier_and_come_back_as_hits(manager: KVCacheManager) -> None:
    m = manager
    a = _request("a", A)
    assert _run(m, a) == [1, 2, 3]
    m.free(a)  # free queue: 4, 3, 2, 1 (tail first)
    assert m.take_transfers() is None

    b = _request("b", B)
    assert _run(m, b) == [4, 3, 2, 1]
    # Blocks 2 and 1 held a's two hashed blocks; block 3 (a's partial tail) had no hash.
    t = m.take_transfers()
    assert t is not None
    assert t.stores == [(2, _h(A)[1]), (1, _h(A)[0])]
    assert t.loads == [] and t.drops == []
    m.free(b)  # free queue: 1, 2, 3, 4

    c = _request("c", A)
    hits, num_hit = m.get_computed_blocks(c)
    assert (hits, num_hit) == ([], 0)
    assert m.load_from_tier(c, hits)
    t = m.take_transfers()
    assert t is not None
    # Two fresh blocks (evicting b's last two, which are stored first) receive a's two blocks.
    assert t.stores == [(1, _h(B)[3]), (2, _h(B)[2])]
    assert t.loads == [(1, _h(A)[0]), (2, _h(A)[1])]
    assert t.load_req_ids == ["c"]
    # Not registered before the copy is done: nobody can hit them yet.
    assert m.block_pool.get_cached_block(_h(A)[0]) is None

    assert m.finish_transfers(t, []) == ["c"]
    hits, num_hit = m.get_computed_blocks(c)
    assert [b.block_id for b in hits] == [1, 2] and num_hit == 8
    new = m.allocate_slots(c, 1, hits, num_hit)
    assert [b.block_id for b in new] == [3]
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    # Counted once, as one request with 8 hit tokens; the tier counts the 8 it supplied.
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2 + 1, 9 + 16 + 9, 8)
    offload = m.make_offload_stats()
    assert offload is not None
    assert (offload.tier, offload.queries, offload.hits, offload.stores) == ("host", 8, 8, 5)
    assert offload.bytes_stored == 5 * PER_BLOCK and offload.bytes_loaded == 2 * PER_BLOCK


def test_blocks_released_behind_a_window_go_to_the_tier_and_come_back() -> None:
    """A cached block released behind a sliding window (6 keys) is an
    ordinary free cached block: evicted while its request still runs, it
    is stored; a later request loads it back and hits the whole chain,
    then references only the hits its window reaches."""
    m = KVCacheManager(num_blocks=5, block_size=BS, kv_tier=HostKVTier(10 * PER_BLOCK, PER_BLOCK), sliding_window=6)
    a = _request("a", A + [109, 110, 111])
    assert _run(m, a) == [1, 2, 3]
    a.append_output_token_ids([112])
    # c = 12: the next query reads 7 .. 12, so block 0 goes back to the pool, still cached.
    assert [b.block_id for b in m.allocate_slots(a, 1)] == [4]
    assert m.get_block_ids("a") == [0, 2, 3, 4]
    assert m.take_transfers() is None
    b = _request("b", [50, 51, 52])
    assert _run(m, b) == [1]
    t = m.take_transfers()
    assert t is not None and t.stores == [(1, _h(A)[0])]
    for req in (a, b):
        m.free(req)
    m.take_transfers()

    c = _request("c", A + [109, 110, 111, 7])
    hits, num_hit = m.get_computed_blocks(c)
    assert (hits, num_hit) == ([], 0)  # the chain breaks at its first block
    assert m.load_from_tier(c, hits)
    t = m.take_transfers()
    assert t is not None and t.loads == [(4, _h(A)[0])]
    assert m.finish_transfers(t, []) == ["c"]
    hits, num_hit = m.get_computed_blocks(c)
    assert [b.block_id for b in hits] == [4, 2, 3] and num_hit == 12
    # c = 12 again: the loaded block lies behind the window and is not referenced.
    assert [b.block_id for b in m.allocate_slots(c, 1, hits, num_hit)] == [1]
    assert m.get_block_ids("c") == [0, 2, 3, 1]
    assert [m.block_pool.blocks[i].ref_cnt for i in (4, 2, 3, 1)] == [0, 1, 1, 1]


def _load_a_again(m: KVCacheManager) -> tuple[Request, KVTransfers | None]:
    """a's blocks pushed out of the pool by b into the tier; then a request
    for a's tokens starts loading them. Returns it and its step's transfers."""
    for req in (_request("a", A), _request("b", B)):
        _run(m, req)
        m.free(req)
    m.take_transfers()
    c = _request("c", A)
    hits, _ = m.get_computed_blocks(c)
    assert m.load_from_tier(c, hits)
    return c, m.take_transfers()


def test_a_failed_load_is_recomputed_not_read(manager: KVCacheManager) -> None:
    m = manager
    c, t = _load_a_again(m)
    assert t is not None and t.loads == [(1, _h(A)[0]), (2, _h(A)[1])]
    # Block 2 (a's second block) did not arrive: only block 1 becomes a hit.
    assert m.finish_transfers(t, [2]) == ["c"]
    hits, num_hit = m.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [1] and num_hit == 4
    # The tier stops offering the lost hash, and its workers free it.
    t = m.take_transfers()
    assert t is not None and t.drops == [_h(A)[1]]
    offload = m.make_offload_stats()
    assert offload is not None and (offload.hits, offload.load_failures) == (4, 1)
    # One look-up per request: a tier that failed does not hold it back again.
    assert not m.load_from_tier(c, hits)


def test_abort_while_loading_returns_the_blocks(manager: KVCacheManager) -> None:
    m = manager
    c, t = _load_a_again(m)
    assert m.num_free_blocks == 2
    m.free(c)
    assert m.num_free_blocks == 4
    assert t is not None and m.finish_transfers(t, []) == []
    assert m.block_pool.get_cached_block(_h(A)[0]) is None


def test_host_tier_is_an_lru_bounded_in_bytes() -> None:
    tier = HostKVTier(capacity_bytes=2 * PER_BLOCK + 99, bytes_per_block=PER_BLOCK)
    h = [BlockHash(bytes([i]) * 32) for i in range(4)]
    assert tier.admit(h[0]) and tier.admit(h[1])
    assert not tier.admit(h[0])  # held already; now the most recent
    assert tier.admit(h[2])
    assert tier.take_drops() == [h[1]]
    assert tier.lookup([h[0], h[2], h[3]]) == 2
    assert tier.lookup([h[1], h[0]]) == 0
    assert len(tier) == 2
    assert not HostKVTier(PER_BLOCK - 1, PER_BLOCK).admit(h[0])  # room for no block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_io_copies_exact_shards_out_and_in(dtype: torch.dtype) -> None:
    from rayvllm.kernels.kv_layout import KVCacheLayout, kv_cache_shapes

    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(2):
        k_shape, v_shape = kv_cache_shapes(KVCacheLayout.SPLIT, 6, BS, 2, 8)
        caches.append((torch.randn(k_shape, generator=gen).to(dtype), torch.randn(v_shape, generator=gen).to(dtype)))
    before = [(k.clone(), v.clone()) for k, v in caches]
    store = HostKVStore()
    io = KVBlockIO(caches, store)
    h = [BlockHash(bytes([i]) * 32) for i in range(3)]
    # Store blocks 2 and 5, then load them into 1 and 4 (and a hash never stored into 3).
    assert io.apply(KVTransfers(stores=[(2, h[0]), (5, h[1])])) == []
    failed = io.apply(KVTransfers(loads=[(1, h[0]), (4, h[1]), (3, h[2])], drops=[h[1]]))
    assert failed == [3]
    for (k, v), (k0, v0) in zip(caches, before):
        for cache, orig in ((k, k0), (v, v0)):
            assert torch.equal(cache[1], orig[2]) and torch.equal(cache[4], orig[5])
            assert torch.equal(cache[3], orig[3]) and torch.equal(cache[0], orig[0])
    assert len(store) == 1


def test_config_validation_names_the_field(tiny_model_dir: Path) -> None:
    def build(**kw: object) -> None:
        EngineArgs(model=str(tiny_model_dir), **kw).create_engine_config()

    with pytest.raises(InvalidParameterError, match="kv_offloading_size"):
        build(kv_offloading_size=0)
    with pytest.raises(InvalidParameterError, match="kv_offloading_size"):
        build(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(InvalidParameterError, match="kv_offloading_backend"):
        build(kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(InvalidParameterError, match="kv_offloading_backend"):
        build(kv_offloading_backend="ray")
    with pytest.raises(InvalidParameterError, match="kv_offloading_backend"):
        build(kv_offloading_size=1, kv_offloading_backend="ray", distributed_executor_backend="uni")
    with pytest.raises(InvalidParameterError, match="kv_offloading_size"):
        EngineArgs.from_dict({"kv_offloading_size": "lots"})
    parser = argparse.ArgumentParser()
    add_model_args(parser, EngineArgs)
    ns = parser.parse_args(["--kv-offloading-size", "0.5", "--kv-offloading-backend", "ray"])
    assert given_args(ns, EngineArgs) == {"kv_offloading_size": 0.5, "kv_offloading_backend": "ray"}
    config = EngineArgs(model=str(tiny_model_dir), kv_offloading_size=0.5).create_engine_config()
    oc = config.kv_offload_config
    assert oc is not None and (oc.backend, oc.size_bytes, oc.tier_name) == ("native", 1 << 29, "host")
    ray_config = EngineArgs(
        model=str(tiny_model_dir), kv_offloading_size=0.5, kv_offloading_backend="ray"
    ).create_engine_config()
    assert ray_config.parallel_config.use_ray
    assert ray_config.kv_offload_config is not None and ray_config.kv_offload_config.fingerprint == oc.fingerprint
    other = EngineArgs(model=str(tiny_model_dir), kv_offloading_size=0.5, block_size=32).create_engine_config()
    assert other.kv_offload_config is not None and other.kv_offload_config.fingerprint != oc.fingerprint


def _docs(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 4000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize(
    "engine", [{}, {"async_scheduling": True, "max_num_batched_tokens": 32}], ids=["sync", "async-chunked"]
)
def test_greedy_parity_with_blocks_loaded_from_the_host_tier(tiny_model_dir: Path, engine: dict) -> None:
    """Six 64-token documents through a pool of 12 blocks: by the second
    round each document's blocks were evicted, so its prefix comes back
    from the tier, and the tokens still match transformers (also with the
    next step scheduled while a load runs, and prompts in chunks)."""
    llm = LLM(
        model=str(tiny_model_dir), dtype="float32", num_gpu_blocks_override=13, max_model_len=128,
        max_num_seqs=2, kv_offloading_size=1 / 1024, **engine,
    )
    core = llm.llm_engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    docs = _docs(6, 64, seed=5)
    prompts = [doc + [7, 8, 9] for doc in docs] + [doc + [10, 11] for doc in docs]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = core.make_stats()
    offload = stats.kv_offload_stats
    assert offload is not None and offload.tier == "host"
    # Each second-round prompt found its document's 4 blocks in the tier.
    assert offload.hits == 6 * 64 and offload.load_failures == 0
    assert all(o.num_cached_tokens == 64 for o in outputs[6:])
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(tiny_model_dir, prompt)[0][:6]
        assert out.outputs[0].token_ids == expected
    llm.shutdown()


def test_tier_counters_on_metrics() -> None:
    from rayvllm.frontend.metrics import EngineMetrics
    from rayvllm.messages.engine_types import KVOffloadStats, PrefixCacheStats, SchedulerStats

    metrics = EngineMetrics("m")
    offload = KVOffloadStats(tier="host", queries=128, hits=64, stores=5, evictions=2, bytes_stored=500)
    stats = SchedulerStats(1, 0, 0.5, PrefixCacheStats(1, 130, 64), 0, kv_offload_stats=offload)
    metrics.record_scheduler_stats(stats)
    metrics.record_scheduler_stats(stats)
    text = metrics.render()[0].decode()
    assert 'rayvllm:kv_offload_hits_total{model_name="m",tier="host"} 128.0' in text
    assert 'rayvllm:kv_offload_queries_total{model_name="m",tier="host"} 256.0' in text
    assert 'rayvllm:kv_offload_stores_total{model_name="m",tier="host"} 10.0' in text
    assert 'rayvllm:kv_offload_evictions_total{model_name="m",tier="host"} 4.0' in text
    assert 'rayvllm:kv_offload_stored_bytes_total{model_name="m",tier="host"} 1000.0' in text
    assert 'rayvllm:kv_offload_hits_total{model_name="m",tier="ray"} 0.0' in text


def test_prefix_index_counts_a_ranks_own_tier_for_routing() -> None:
    from rayvllm.core.prefix_index import PrefixIndex

    index = PrefixIndex(2)
    tier = HostKVTier(2 * PER_BLOCK, PER_BLOCK, index.tier_listener(1))
    h = _h(B)
    assert tier.admit(h[0]) and tier.admit(h[1])
    assert index.longest_prefix_hits(h) == [0, 2]
    assert index.ranks_holding(h[0]) == frozenset()  # pools only
    assert tier.admit(h[2])  # evicts h[0]: the chain now misses at its head
    assert index.longest_prefix_hits(h) == [0, 0]
    assert index.longest_prefix_hits(h[1:]) == [0, 2]
    index.clear_rank(1)
    assert len(index) == 0


def test_dp_routes_to_the_rank_whose_host_tier_holds_the_prefix(tiny_model_dir: Path) -> None:
    from rayvllm.engine.engine_core import EngineCore
    from rayvllm.executor.uniproc import UniProcExecutor

    config = EngineArgs(
        model=str(tiny_model_dir), dtype="float32", data_parallel_size=2, max_model_len=128, max_num_seqs=2,
        num_gpu_blocks_override=13, kv_offloading_size=1 / 1024,
    ).create_engine_config()
    core = EngineCore(config, lambda rank: UniProcExecutor(config))
    greedy = Params(temperature=0.0, max_tokens=6, ignore_eos=True)
    doc, *others = _docs(5, 64, seed=8)
    tokens: dict[str, list[int]] = {}

    def run(*requests: tuple[str, list[int]]) -> list[int]:
        for req_id, prompt in requests:
            core.add_request(EngineCoreRequest(req_id, prompt, greedy, eos_token_id=None))
        ranks = [core.request_rank[req_id] for req_id, _ in requests]
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return ranks

    try:
        # Rank 0 is busy each time, so rank 1 computes the document, then three others.
        assert run(("busy", others[0] + [1]), ("doc", doc + [7, 8, 9])) == [0, 1]
        for i, other in enumerate(others[1:]):
            assert run((f"busy{i}", others[0] + [2 + i]), (f"other{i}", other + [7])) == [0, 1]
        assert core.schedulers[1].kv_cache_manager.block_pool.get_cached_block(_h(doc)[0]) is None
        core.schedulers[1].kv_cache_manager.make_offload_stats()
        # Both ranks idle: rank 0 would win the tie, but rank 1's tier holds the prefix.
        assert run(("again", doc + [10, 11])) == [1]
        offload = core.schedulers[1].kv_cache_manager.make_offload_stats()
        assert offload is not None and offload.hits == 64
        assert tokens["again"] == hf_greedy(tiny_model_dir, doc + [10, 11])[0][:6]
    finally:
        core.shutdown()


def test_scheduler_parks_a_loading_request_and_resumes_or_drops_it() -> None:
    from rayvllm.config import CacheConfig, SchedulerConfig
    from rayvllm.core.sched.scheduler import Scheduler
    from rayvllm.messages.engine_types import ModelRunnerOutput

    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=BS, num_blocks=5),
        kv_tier=HostKVTier(10 * PER_BLOCK, PER_BLOCK),
    )

    def step(*sampled: str) -> tuple[list[str], KVTransfers | None]:
        so = sched.schedule()
        sched.update_from_output(so, ModelRunnerOutput(list(sampled), [5] * len(sampled), None, {}))
        return list(so.num_scheduled_tokens), so.kv_transfers

    for req_id, tokens in (("a", A), ("b", B)):
        sched.add_request(_request(req_id, tokens))
        assert step(req_id)[0] == [req_id]
        sched.abort_requests([req_id])  # its blocks stay cached, then b's push a's out
    for req_id in ("c", "d"):
        sched.add_request(_request(req_id, A))
    so = sched.schedule()
    # c loads a's two blocks (a step with no tokens: nothing to compute
    # yet); d, wanting the same, follows c's load instead of copying again.
    assert so.num_scheduled_tokens == {} and not so.is_empty
    assert so.kv_transfers is not None and so.kv_transfers.load_req_ids == ["c", "d"]
    assert so.kv_transfers.loads == [(1, _h(A)[0]), (2, _h(A)[1])]
    assert list(sched.loading) == ["c", "d"] and sched.make_stats().num_waiting_reqs == 2
    sched.update_from_output(so, ModelRunnerOutput([], [], None, {}))
    # Back in their order, each computes its last token only, on blocks 1 and 2.
    assert step("c", "d")[0] == ["c", "d"]
    assert [sched.kv_cache_manager.get_block_ids(r) for r in ("c", "d")] == [[1, 2, 3], [1, 2, 4]]
    assert [r.num_cached_tokens for r in sched.running] == [8, 8]

    # Aborted while its copy runs: gone, and the returning step is harmless.
    for req_id in ("c", "d"):
        sched.abort_requests([req_id])
    sched.add_request(_request("e", B))
    step("e")
    sched.abort_requests(["e"])
    sched.add_request(_request("f", A))
    so = sched.schedule()
    assert so.kv_transfers is not None and so.kv_transfers.load_req_ids == ["f"]
    assert sched.abort_requests(["f"]) == ["f"] and not sched.loading
    sched.update_from_output(so, ModelRunnerOutput([], [], None, {}))
    assert not sched.has_unfinished_requests() and len(sched.waiting) == 0
    assert sched.kv_cache_manager.num_free_blocks == 4
