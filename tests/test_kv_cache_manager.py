"""KVCacheManager: prefix hits, allocation, eviction order and stats, with exact block ids."""

from __future__ import annotations

import random

import pytest

from rayvllm.core.block_pool import KVCacheBlock
from rayvllm.core.kv_cache_manager import KVCacheManager
from rayvllm.core.request import Request
from rayvllm.messages.block_hash import BlockHash, hash_request_tokens, request_extra_keys
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


# ---------------------------------------------------------------- sliding window
# A window of 6 keys over blocks of 4: a query at p reads p - 5 .. p, so
# once c tokens are computed the blocks before (c - 5) // 4 are released.
WINDOW = 6


def decode(m: KVCacheManager, req: Request, token: int) -> list[int] | None:
    """One decode step: the last token's KV is computed, `token` sampled."""
    new = m.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
        req.append_output_token_ids([token])
    return ids(new)


def test_window_releases_exact_blocks_as_decode_moves_on() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4, sliding_window=WINDOW)
    a = make_request("a", list(range(10)))
    assert schedule(m, a, 10) == [1, 2, 3]
    first_hash = m.req_to_block_hashes["a"][0]
    # c = 10: the next query (position 10) reads 5 .. 10, so block 0 (positions 0-3) goes.
    assert decode(m, a, 100) == []
    assert m.get_block_ids("a") == [0, 2, 3]
    assert (m.get_num_blocks("a"), m.get_num_held_blocks("a")) == (3, 2)
    # Released but cached: free, at the back of the queue, still a prefix hit.
    assert ref_cnts(m, [1]) == [0]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 1]
    assert m.block_pool.get_cached_block(first_hash) is m.block_pool.blocks[1]
    assert decode(m, a, 101) == []  # c = 11: reads 6 .. 11, block 1 still needed
    assert decode(m, a, 102) == [4]  # c = 12: position 12 opens block 3
    assert m.get_block_ids("a") == [0, 2, 3, 4]
    assert decode(m, a, 103) == []  # c = 13: reads 8 .. 13, block 1 goes
    assert m.get_block_ids("a") == [0, 0, 3, 4]
    assert free_ids(m) == [5, 6, 7, 8, 9, 1, 2]
    for token in (104, 105, 106):
        decode(m, a, token)
    assert m.get_block_ids("a") == [0, 0, 3, 4, 5]  # c = 16: reads 11 .. 16
    decode(m, a, 107)
    assert m.get_block_ids("a") == [0, 0, 0, 4, 5]  # c = 17: reads 12 .. 17
    assert m.num_released_blocks["a"] == 3
    m.free(a)
    assert free_ids(m) == [6, 7, 8, 9, 1, 2, 3, 5, 4]
    assert m.usage == 0.0


def test_window_bound_on_held_blocks() -> None:
    """While decoding a request holds at most ceil((W - 1) / bs) + 1 blocks
    (3 here), and exactly that many at every block boundary, however long it
    runs; without a window it holds them all."""
    for window, bs, bound in ((6, 4, 3), (8, 4, 3), (9, 4, 3), (5, 4, 2), (1, 4, 1), (16, 16, 2), (17, 16, 2)):
        m = KVCacheManager(num_blocks=200, block_size=bs, sliding_window=window)
        a = make_request("a", list(range(7)))
        schedule(m, a, 7)
        held = []
        for token in range(300):
            decode(m, a, token)
            held.append(m.get_num_held_blocks("a"))
        assert max(held[window:]) == bound == -(-(window - 1) // bs) + 1, (window, bs, held)
    full = KVCacheManager(num_blocks=200, block_size=4)
    a = make_request("a", list(range(7)))
    schedule(full, a, 7)
    for token in range(300):
        decode(full, a, token)
    assert full.get_num_held_blocks("a") == -(-307 // 4)


def test_window_chunked_prefill_releases_and_reuses_blocks() -> None:
    """The blocks a chunk releases are supply for the same call: 4 usable
    blocks carry a 24-token prompt in chunks of 8."""
    m = KVCacheManager(num_blocks=5, block_size=4, sliding_window=WINDOW)
    a = make_request("a", list(range(24)))
    assert ids(m.allocate_slots(a, 8)) == [1, 2]
    a.num_computed_tokens = 8
    # c = 8: the chunk's first query (8) reads from 3: nothing to release.
    assert ids(m.allocate_slots(a, 8)) == [3, 4]
    a.num_computed_tokens = 16
    assert m.num_free_blocks == 0
    # c = 16: reads from 11, so blocks 0 and 1 go and come back as 4 and 5.
    assert ids(m.allocate_slots(a, 8)) == [2, 1]
    assert m.get_block_ids("a") == [0, 0, 3, 4, 2, 1]
    # The released blocks were cached, then evicted by their reuse.
    assert m.block_pool.get_cached_block(m.req_to_block_hashes["a"][0]) is None
    a.num_computed_tokens = 24
    # Without a window the same pool cannot take the third chunk.
    full = KVCacheManager(num_blocks=5, block_size=4)
    b = make_request("b", list(range(24)))
    full.allocate_slots(b, 16)
    b.num_computed_tokens = 16
    assert full.allocate_slots(b, 8) is None


def test_window_allocation_failure_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=6, block_size=4, sliding_window=WINDOW)
    a = make_request("a", list(range(20)))
    schedule(m, a, 16)
    assert m.num_free_blocks == 1
    # c = 16 releases blocks 0 and 1: with the free one, supply for 1 new block.
    assert ids(m.allocate_slots(a, 4)) == [5]
    a.num_computed_tokens = 20
    assert m.get_block_ids("a") == [0, 0, 3, 4, 5]
    # c = 20 would release block 2 too, but 24 more tokens need 6 blocks and 3 would be free.
    before = (m.get_block_ids("a"), free_ids(m), dict(m.num_released_blocks), ref_cnts(m, [1, 2, 3, 4, 5]))
    assert m.allocate_slots(a, 24) is None
    assert (m.get_block_ids("a"), free_ids(m), dict(m.num_released_blocks), ref_cnts(m, [1, 2, 3, 4, 5])) == before


def test_window_shared_block_is_released_by_reference() -> None:
    """A block another request also holds is only unreferenced: it stays
    owned, and is no supply."""
    m = KVCacheManager(num_blocks=10, block_size=4, sliding_window=WINDOW)
    a = make_request("a", list(range(10)))
    schedule(m, a, 10)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert schedule(m, b, 11) == [4]
    assert m.get_block_ids("b") == [1, 2, 4]  # c = 0 when the hits came: all kept
    assert ref_cnts(m, [1, 2]) == [2, 2]
    decode(m, a, 100)  # a's c = 10 releases its block 0
    assert m.get_block_ids("a") == [0, 2, 3]
    assert ref_cnts(m, [1]) == [1]
    assert 1 not in free_ids(m)
    decode(m, b, 100)  # b's c = 11 releases its block 0: now free
    assert m.get_block_ids("b") == [0, 2, 4]
    assert free_ids(m)[-1] == 1


def test_window_prefix_hits_before_the_window_are_not_held() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4, sliding_window=WINDOW)
    a = make_request("a", list(range(17)))
    schedule(m, a, 17)
    m.free(a)
    b = make_request("b", list(range(16)) + [60, 61])
    hits, num_hit = m.get_computed_blocks(b)
    assert (ids(hits), num_hit) == ([1, 2, 3, 4], 16)
    # c = 16 once the hits count: the first query (16) reads from 11, so hits 0, 1 are not referenced.
    assert ids(m.allocate_slots(b, 2, hits, num_hit)) == [6]
    assert m.get_block_ids("b") == [0, 0, 3, 4, 6]
    assert (m.num_released_blocks["b"], m.num_cached_blocks["b"]) == (2, 4)
    assert ref_cnts(m, [1, 2, 3, 4]) == [0, 0, 1, 1]
    # Left where they were in the free queue, still hits for the next request.
    assert free_ids(m) == [7, 8, 9, 5, 2, 1]
    c = make_request("c", list(range(16)) + [70])
    assert ids(m.get_computed_blocks(c)[0]) == [1, 2, 3, 4]
    m.free(b)
    assert m.usage == 0.0


def test_window_releases_blocks_filled_by_accepted_drafts_as_hits() -> None:
    """A block that accepted drafts filled was not hashed when scheduled
    (its tokens were unknown); released by the next step, it is hashed first."""
    m = KVCacheManager(num_blocks=20, block_size=4, sliding_window=2)
    a = make_request("a", list(range(4)))
    schedule(m, a, 4)
    a.append_output_token_ids([4])
    # Position 4 (the last token) and drafts 5 .. 8; every draft accepted, plus the bonus token.
    assert ids(m.allocate_slots(a, 5)) == [2, 3]
    a.num_computed_tokens = 9
    a.append_output_token_ids([5, 6, 7, 8, 9])
    assert m.num_cached_blocks["a"] == 1  # block 1 (positions 4-7) was not known when scheduled
    # c = 9: the query at 9 reads 8 .. 9, so blocks 0 and 1 go, both hashed.
    decode(m, a, 10)
    assert m.get_block_ids("a") == [0, 0, 3]
    hashes = m.req_to_block_hashes["a"]
    assert [m.block_pool.get_cached_block(h) for h in hashes[:2]] == [m.block_pool.blocks[1], m.block_pool.blocks[2]]


def test_window_rejected_drafts_never_need_a_released_block() -> None:
    """Random chunks, drafts and rejections: after every step, every block
    the next step's queries can read is held, and the bound holds."""
    rng = random.Random(0)
    bs, window = 4, 7
    m = KVCacheManager(num_blocks=400, block_size=bs, sliding_window=window)
    a = make_request("a", [rng.randrange(1000) for _ in range(30)])
    while a.num_computed_tokens < a.num_tokens:  # chunked prefill
        n = min(rng.randint(1, 9), a.num_tokens - a.num_computed_tokens)
        assert m.allocate_slots(a, n) is not None
        a.num_computed_tokens += n
    a.append_output_token_ids([rng.randrange(1000)])
    for _ in range(300):
        c = a.num_computed_tokens
        num_draft = rng.randint(0, 4)
        assert m.allocate_slots(a, 1 + num_draft) is not None
        table = m.get_block_ids("a")
        # This step's queries (c .. c + num_draft) read from c - window + 1 on.
        assert 0 not in table[max(c - window + 1, 0) // bs :]
        assert m.get_num_held_blocks("a") <= -(-(window + num_draft - 1) // bs) + 1
        accepted = rng.randint(0, num_draft)
        a.num_computed_tokens = c + 1 + accepted
        a.append_output_token_ids([rng.randrange(1000) for _ in range(accepted + 1)])
        # Rejections take computed tokens back to c + 1 at least: what the next step reads is held.
        assert 0 not in table[max(a.num_computed_tokens - window + 1, 0) // bs :]
    m.free(a)
    assert m.usage == 0.0 and all(b.ref_cnt == 0 for b in m.block_pool.blocks)


def test_window_preemption_frees_everything_and_recomputes_from_the_cache() -> None:
    m = KVCacheManager(num_blocks=12, block_size=4, sliding_window=WINDOW)
    a = make_request("a", list(range(10)))
    schedule(m, a, 10)
    for token in range(100, 108):
        decode(m, a, token)
    assert m.get_block_ids("a") == [0, 0, 0, 4, 5]
    m.free(a)  # preempted: recomputed from token 0
    a.num_computed_tokens = 0
    assert m.usage == 0.0 and "a" not in m.num_released_blocks
    hits, num_hit = m.get_computed_blocks(a)
    assert (ids(hits), num_hit) == ([1, 2, 3, 4], 16)
    # c = 16: hits 0, 1 lie before the window; the partial block 4 is computed again.
    assert ids(m.allocate_slots(a, 2, hits, num_hit)) == [6]
    assert m.get_block_ids("a") == [0, 0, 3, 4, 6]


def test_window_without_caching_frees_released_blocks_uncached() -> None:
    m = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False, sliding_window=WINDOW)
    a = make_request("a", list(range(10)))
    schedule(m, a, 10)
    decode(m, a, 100)
    assert m.get_block_ids("a") == [0, 2, 3]
    assert free_ids(m) == [4, 5, 6, 7, 8, 9, 1]
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(num_blocks=10, block_size=4, sliding_window=0)


class _Events:
    """A pool listener recording what block events and the prefix index would see."""

    def __init__(self) -> None:
        self.log: list[tuple[str, BlockHash]] = []

    def on_block_cached(self, block_hash: BlockHash) -> None:
        self.log.append(("cached", block_hash))

    def on_block_evicted(self, block_hash: BlockHash) -> None:
        self.log.append(("evicted", block_hash))


def test_window_release_is_no_block_event() -> None:
    """A released block keeps its hash: the listener (block events, the DP
    prefix index) hears of it only when the pool hands it out again."""
    events = _Events()
    m = KVCacheManager(num_blocks=5, block_size=4, sliding_window=WINDOW, listener=events)
    a = make_request("a", list(range(10)))
    schedule(m, a, 10)
    first, second = m.req_to_block_hashes["a"]
    assert events.log == [("cached", first), ("cached", second)]
    decode(m, a, 100)
    assert m.get_block_ids("a") == [0, 2, 3]
    assert events.log == [("cached", first), ("cached", second)]
    b = make_request("b", [50, 51])
    assert schedule(m, b, 2) == [4]
    assert schedule(m, make_request("c", [60, 61]), 2) == [1]  # the released block, reused
    assert events.log[-1] == ("evicted", first)
