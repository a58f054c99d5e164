"""KVCacheManager: prefix hits, allocation, eviction order and stats, with exact block ids."""

from __future__ import annotations

import pytest

from rayvllm.core.block_pool import KVCacheBlock
from rayvllm.core.kv_cache_manager import KVCacheManager
from rayvllm.core.request import Request
from rayvllm.messages.block_hash import hash_request_tokens, request_extra_keys
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.sampling_params import SamplingParams


def make_request(
    request_id: str,
    token_ids: list[int],
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    return Request(
        EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs),
            eos_token_id=None,
            cache_salt=cache_salt,
        )
    )


def ids(blocks: list[KVCacheBlock] | None) -> list[int] | None:
    return None if blocks is None else [b.block_id for b in blocks]


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(m: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [m.block_pool.blocks[i].ref_cnt for i in block_ids]


def schedule(m: KVCacheManager, req: Request, num_new_tokens: int) -> list[int] | None:
    """Mimic the scheduler for a fresh request: look up, allocate, advance."""
    hits, num_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, num_new_tokens - num_hit, hits, num_hit)
    if new is not None:
        req.num_computed_tokens = num_hit + (num_new_tokens - num_hit)
    return ids(new)


A_TOKENS = list(range(10))


def test_first_request_then_prefix_hit_and_eviction_order() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    assert m.get_computed_blocks(a) == ([], 0)
    assert ids(m.allocate_slots(a, 10)) == [1, 2, 3]
    a.num_computed_tokens = 10
    assert m.get_block_ids("a") == [1, 2, 3]
    assert m.get_num_blocks("a") == 3
    assert ref_cnts(m, [1, 2, 3]) == [1, 1, 1]
    # Full blocks are hashed as soon as they are scheduled; the partial tail is not.
    blocks = m.block_pool.blocks
    assert blocks[1].block_hash is not None and blocks[2].block_hash is not None
    assert blocks[3].block_hash is None

    m.free(a)
    # Tail first: 3 is evicted before 2 before 1, after the never-used blocks.
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert m.get_block_ids("a") == []

    b = make_request("b", A_TOKENS[:8] + [100, 101])
    hits, num_hit = m.get_computed_blocks(b)
    assert (ids(hits), num_hit) == ([1, 2], 8)
    assert ids(m.allocate_slots(b, 2, hits, num_hit)) == [4]
    assert m.get_block_ids("b") == [1, 2, 4]
    assert ref_cnts(m, [1, 2, 4]) == [1, 1, 1]
    assert free_ids(m) == [5, 6, 7, 8, 9, 3]


def test_last_token_is_never_a_hit() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    schedule(m, a, 10)
    m.free(a)
    # 8 tokens = exactly two cached blocks, but the last token must be computed.
    c = make_request("c", A_TOKENS[:8])
    hits, num_hit = m.get_computed_blocks(c)
    assert (ids(hits), num_hit) == ([1], 4)
    assert ids(m.allocate_slots(c, 4, hits, num_hit)) == [4]
    assert m.get_block_ids("c") == [1, 4]
    # Block 2 stays cached and free; block 4 now holds the same hash too.
    assert m.block_pool.blocks[2].ref_cnt == 0
    assert m.block_pool.blocks[4].block_hash == m.block_pool.blocks[2].block_hash


def test_shared_blocks_between_running_requests() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    assert schedule(m, a, 10) == [1, 2, 3]
    b = make_request("b", A_TOKENS[:8] + [100, 101, 102])
    assert schedule(m, b, 11) == [4]
    assert m.get_block_ids("b") == [1, 2, 4]
    assert ref_cnts(m, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert m.num_free_blocks == 5
    m.free(a)
    assert ref_cnts(m, [1, 2, 3]) == [1, 1, 0]
    assert free_ids(m) == [5, 6, 7, 8, 9, 3]
    m.free(b)
    assert free_ids(m) == [5, 6, 7, 8, 9, 3, 4, 2, 1]
    assert m.usage == 0.0


def test_identical_prompts_in_one_step_both_allocate() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    b = make_request("b", A_TOKENS)
    # Both look up before either allocates (same scheduling step).
    hits_a = m.get_computed_blocks(a)
    hits_b = m.get_computed_blocks(b)
    assert hits_a == ([], 0) and hits_b == ([], 0)
    assert ids(m.allocate_slots(a, 10)) == [1, 2, 3]
    assert ids(m.allocate_slots(b, 10)) == [4, 5, 6]
    c = make_request("c", A_TOKENS)
    assert ids(m.get_computed_blocks(c)[0]) == [1, 2]
    m.free(a)
    m.free(b)
    # a's blocks get evicted first (they are older in the queue) but b's copies survive.
    assert free_ids(m) == [7, 8, 9, 3, 2, 1, 6, 5, 4]
    m.block_pool.get_new_blocks(6)  # evicts 7, 8, 9, 3, 2, 1
    assert ids(m.get_computed_blocks(c)[0]) == [4, 5]


def test_chunked_prefill_caches_blocks_as_they_fill() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    assert ids(m.allocate_slots(a, 5)) == [1, 2]
    a.num_computed_tokens = 5
    pool = m.block_pool
    assert pool.blocks[1].block_hash is not None
    assert pool.blocks[2].block_hash is None  # only 1 token of block 2 scheduled
    assert ids(m.allocate_slots(a, 5)) == [3]
    a.num_computed_tokens = 10
    assert pool.blocks[2].block_hash is not None
    assert pool.blocks[3].block_hash is None
    assert m.req_to_block_hashes["a"] == hash_request_tokens(4, A_TOKENS)


def test_decode_allocates_and_caches_incrementally() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    assert schedule(m, a, 6) == [1, 2]
    pool = m.block_pool
    assert pool.blocks[2].block_hash is None
    # Sampled token 7 (position 6) fits block 2.
    a.append_output_token_ids([7])
    assert ids(m.allocate_slots(a, 1)) == []
    a.num_computed_tokens = 7
    assert pool.blocks[2].block_hash is None
    # Token 8 fills block 2: it is hashed now.
    a.append_output_token_ids([8])
    assert ids(m.allocate_slots(a, 1)) == []
    a.num_computed_tokens = 8
    assert pool.blocks[2].block_hash is not None
    assert len(m.req_to_block_hashes["a"]) == 2
    # Token 9 needs a new block.
    a.append_output_token_ids([9])
    assert ids(m.allocate_slots(a, 1)) == [3]
    assert m.get_block_ids("a") == [1, 2, 3]
    assert m.req_to_block_hashes["a"] == hash_request_tokens(4, a.all_token_ids)


def test_lookahead_slots_are_not_hashed() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5])
    # Slots for 9 tokens, only 5 known: block 2 is full of slots but not of tokens.
    assert ids(m.allocate_slots(a, 9)) == [1, 2, 3]
    assert m.block_pool.blocks[1].block_hash is not None
    assert m.block_pool.blocks[2].block_hash is None
    assert m.num_cached_blocks["a"] == 1


def test_eviction_removes_cached_block_from_map() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    assert schedule(m, a, 9) == [1, 2, 3]
    m.free(a)
    assert free_ids(m) == [3, 2, 1]
    b = make_request("b", [50, 51, 52, 53, 54])
    assert schedule(m, b, 5) == [3, 2]  # evicts a's second block
    # Block 2 lost a's hash (b's partial tail has none); block 3 holds b's first block.
    assert m.block_pool.blocks[2].block_hash is None
    assert m.block_pool.blocks[3].block_hash == m.req_to_block_hashes["b"][0]
    again = make_request("a2", list(range(9)))
    hits, num_hit = m.get_computed_blocks(again)
    # Chain breaks at the evicted block even though nothing else changed.
    assert (ids(hits), num_hit) == ([1], 4)


def test_allocate_returns_none_without_changing_state() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    assert schedule(m, a, 8) == [1, 2]
    b = make_request("b", list(range(100, 109)))
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.allocate_slots(b, 9) is None
    assert m.get_block_ids("b") == [] and "b" not in m.req_to_blocks
    assert m.num_free_blocks == 1 and free_ids(m) == [3]
    # A running request that cannot grow also gets None and keeps its blocks.
    a.num_computed_tokens = 8
    assert m.allocate_slots(a, 9) is None
    assert m.get_block_ids("a") == [1, 2]
    assert m.num_cached_blocks["a"] == 2


def test_allocate_counts_free_cached_hits_against_supply() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    schedule(m, a, 8)
    m.free(a)
    assert free_ids(m) == [3, 2, 1]
    # 13 tokens: hits [1, 2] (both free), 2 more blocks needed, only 1 left
    # once the hits leave the free queue.
    b = make_request("b", list(range(8)) + [90, 91, 92, 93, 94])
    hits, num_hit = m.get_computed_blocks(b)
    assert (ids(hits), num_hit) == ([1, 2], 8)
    assert m.allocate_slots(b, 5, hits, num_hit) is None
    assert ref_cnts(m, [1, 2, 3]) == [0, 0, 0]
    assert free_ids(m) == [3, 2, 1]
    assert m.block_pool.get_cached_block(m.req_to_block_hashes["b"][1]) is m.block_pool.blocks[2]
    assert m.get_block_ids("b") == []
    # 12 tokens fit: hits [1, 2] plus one fresh block.
    c = make_request("c", list(range(8)) + [90, 91, 92, 93])
    hits, num_hit = m.get_computed_blocks(c)
    assert ids(m.allocate_slots(c, 4, hits, num_hit)) == [3]
    assert m.get_block_ids("c") == [1, 2, 3]
    assert m.num_free_blocks == 0
    assert m.usage == 1.0


def test_cache_salt_isolation() -> None:
    m = KVCacheManager(num_blocks=20, block_size=4)
    x = make_request("x", A_TOKENS, cache_salt="tenant-x")
    assert schedule(m, x, 10) == [1, 2, 3]
    m.free(x)
    y = make_request("y", A_TOKENS, cache_salt="tenant-y")
    assert m.get_computed_blocks(y) == ([], 0)
    unsalted = make_request("u", A_TOKENS)
    assert m.get_computed_blocks(unsalted) == ([], 0)
    x2 = make_request("x2", A_TOKENS, cache_salt="tenant-x")
    hits, num_hit = m.get_computed_blocks(x2)
    assert (ids(hits), num_hit) == ([1, 2], 8)
    assert m.req_to_block_hashes["x2"] == hash_request_tokens(
        4, A_TOKENS, request_extra_keys("tenant-x")
    )


def test_prompt_logprobs_skip_lookup_but_still_cache() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    schedule(m, a, 10)
    m.free(a)
    m.make_prefix_cache_stats()
    p = make_request("p", A_TOKENS, prompt_logprobs=1)
    assert m.get_computed_blocks(p) == ([], 0)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    # Its own blocks are still registered for others.
    p2 = make_request("p2", [70, 71, 72, 73, 74], prompt_logprobs=0)
    assert schedule(m, p2, 5) == [4, 5]
    q = make_request("q", [70, 71, 72, 73, 74])
    assert ids(m.get_computed_blocks(q)[0]) == [4]


def test_prefix_cache_stats() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    schedule(m, a, 10)
    b = make_request("b", A_TOKENS[:8] + [100, 101])
    schedule(m, b, 10)
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    # Returned and reset.
    again = m.make_prefix_cache_stats()
    assert (again.requests, again.queries, again.hits) == (0, 0, 0)
    assert stats.requests == 2


def test_usage_and_free_counts() -> None:
    m = KVCacheManager(num_blocks=11, block_size=4)
    assert m.usage == 0.0 and m.num_free_blocks == 10
    a = make_request("a", A_TOKENS)
    schedule(m, a, 10)
    assert m.usage == pytest.approx(0.3)
    assert m.num_free_blocks == 7
    m.free(a)
    # Freed cached blocks count as free: they can be evicted on demand.
    assert m.usage == 0.0 and m.num_free_blocks == 10


def test_reset_prefix_cache() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    schedule(m, a, 10)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.block_pool.cached_block_hash_to_block == {}
    b = make_request("b", A_TOKENS)
    assert m.get_computed_blocks(b) == ([], 0)


def test_preempted_request_resumes_from_its_own_cache() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    schedule(m, a, 6)
    a.append_output_token_ids([7, 8, 9])
    m.allocate_slots(a, 3)
    a.num_computed_tokens = 9
    assert m.get_block_ids("a") == [1, 2, 3]
    # Preemption: free and restart from zero.
    m.free(a)
    a.num_computed_tokens = 0
    assert "a" not in m.req_to_block_hashes
    hits, num_hit = m.get_computed_blocks(a)
    assert (ids(hits), num_hit) == ([1, 2], 8)
    # Block 3 (uncached tail) went to the back of the queue; 4 is at the front.
    assert ids(m.allocate_slots(a, 1, hits, num_hit)) == [4]
    assert m.get_block_ids("a") == [1, 2, 4]


def test_misuse_is_rejected() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", A_TOKENS)
    schedule(m, a, 10)
    m.free(a)
    b = make_request("b", A_TOKENS)
    hits, num_hit = m.get_computed_blocks(b)
    with pytest.raises(ValueError):
        m.allocate_slots(b, 2, hits, num_hit - 1)
    with pytest.raises(ValueError):
        m.allocate_slots(b, -1)
    assert m.get_block_ids("b") == []
    # Freeing a request that holds nothing is a no-op.
    m.free(make_request("never", [1]))
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=10, block_size=0)


def test_caching_disabled() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a = make_request("a", A_TOKENS)
    assert m.get_computed_blocks(a) == ([], 0)
    assert ids(m.allocate_slots(a, 10)) == [1, 2, 3]
    a.num_computed_tokens = 10
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.req_to_block_hashes == {}
    m.free(a)
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    b = make_request("b", A_TOKENS)
    assert m.get_computed_blocks(b) == ([], 0)
    assert ids(m.allocate_slots(b, 10)) == [4, 5, 6]
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert m.usage == pytest.approx(3 / 9)
    assert m.reset_prefix_cache() is False
