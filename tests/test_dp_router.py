"""DP routing: the global prefix index follows real KV cache managers, and new
requests go to the longest exact prefix hit, then the least load, then the
lowest rank."""

from __future__ import annotations

import pytest

from rayvllm.core.block_pool import BlockPool, KVCacheBlock
from rayvllm.core.dp_router import DPRouter, RankLoad
from rayvllm.core.kv_cache_manager import KVCacheManager
from rayvllm.core.prefix_index import PrefixIndex
from rayvllm.core.request import Request
from rayvllm.messages.block_hash import BlockHash, hash_request_tokens, request_extra_keys

from test_kv_cache_manager import make_request

BS = 4

# A long shared prefix: 8 full blocks.
PREFIX = list(range(100, 132))


def prefill(m: KVCacheManager, req: Request) -> list[int]:
    """Schedule the whole prompt the way the scheduler does; return the block table."""
    hits, num_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return m.get_block_ids(req.request_id)


def managers(index: PrefixIndex, num_blocks: int) -> list[KVCacheManager]:
    return [
        KVCacheManager(num_blocks, BS, listener=index.listener(r)) for r in range(index.num_ranks)
    ]


def chain(tokens: list[int], salt: str | None = None) -> list[BlockHash]:
    return hash_request_tokens(BS, tokens, request_extra_keys(salt))


IDLE = RankLoad(num_queued_tokens=0, kv_usage=0.0)
BUSY = RankLoad(num_queued_tokens=1000, kv_usage=0.9)


# ------------------------------------------------------ pool listener contract


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, BlockHash]] = []

    def on_block_cached(self, block_hash: BlockHash) -> None:
        self.events.append(("cached", block_hash))

    def on_block_evicted(self, block_hash: BlockHash) -> None:
        self.events.append(("evicted", block_hash))


def test_pool_fires_on_first_cached_and_last_evicted_only() -> None:
    rec = Recorder()
    pool = BlockPool(6, True, rec)
    h = chain(list(range(8)))
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, h, 0, 2)
    assert rec.events == [("cached", h[0]), ("cached", h[1])]
    # A second copy of the same hashes (computed concurrently) is silent.
    b = pool.get_new_blocks(2)
    pool.cache_full_blocks(b, h, 0, 2)
    assert [blk.block_id for blk in a + b] == [1, 2, 3, 4]
    assert len(rec.events) == 2
    pool.free_blocks(a)
    pool.free_blocks(b)
    # Free queue is [5, 1, 2, 3, 4]: evicting 1 and 2 leaves copies 3 and 4.
    pool.get_new_blocks(3)
    assert len(rec.events) == 2
    # Evicting the last copies fires, in eviction order.
    pool.get_new_blocks(2)
    assert rec.events[2:] == [("evicted", h[0]), ("evicted", h[1])]


def test_pool_reset_reports_every_hash_and_refusal_reports_none() -> None:
    rec = Recorder()
    pool = BlockPool(6, True, rec)
    h = chain(list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, h, 0, 3)
    assert pool.reset_prefix_cache() is False
    assert len(rec.events) == 3
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert rec.events[3:] == [("evicted", h[0]), ("evicted", h[1]), ("evicted", h[2])]


def test_pool_without_caching_fires_nothing() -> None:
    rec = Recorder()
    pool = BlockPool(6, False, rec)
    blocks: list[KVCacheBlock] = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, chain(list(range(8))), 0, 2)
    assert rec.events == []


# -------------------------------------------------------------- (a) the index


def test_index_tracks_two_real_managers() -> None:
    index = PrefixIndex(2)
    m0, m1 = managers(index, num_blocks=9)
    tokens = list(range(10))
    h = chain(tokens)
    assert len(h) == 2

    a = make_request("a", tokens)
    assert prefill(m0, a) == [1, 2, 3]
    assert index.ranks_holding(h[0]) == frozenset({0})
    assert index.ranks_holding(h[1]) == frozenset({0})
    assert (len(index), index.num_hashes(0), index.num_hashes(1)) == (2, 2, 0)

    a1 = make_request("a1", tokens)
    prefill(m1, a1)
    assert index.ranks_holding(h[0]) == frozenset({0, 1})
    assert (len(index), index.num_hashes(0), index.num_hashes(1)) == (2, 2, 2)

    # A duplicate copy on rank 0 (no lookup, so fresh blocks get the same hashes).
    b = make_request("b", tokens)
    assert m0.allocate_slots(b, 10) is not None
    assert m0.get_block_ids("b") == [4, 5, 6]
    assert index.num_hashes(0) == 2

    m0.free(a)
    m0.free(b)
    # Free queue [7, 8, 3, 2, 1, 6, 5, 4]: 5 blocks evict a's copies (2, 1) only.
    filler = make_request("f1", list(range(1000, 1017)))
    assert prefill(m0, filler) == [7, 8, 3, 2, 1]
    assert index.ranks_holding(h[0]) == frozenset({0, 1})
    # The next 3 take b's copies: now rank 0 holds neither hash.
    filler2 = make_request("f2", list(range(2000, 2012)))
    assert prefill(m0, filler2) == [6, 5, 4]
    assert index.ranks_holding(h[0]) == frozenset({1})
    assert index.ranks_holding(h[1]) == frozenset({1})
    # Rank 0 now holds the fillers' 4 + 3 full blocks and nothing else.
    assert index.num_hashes(0) == 7
    assert index.longest_prefix_hits(h) == [0, 2]
    assert index.longest_prefix_hits(chain(list(range(1000, 1016)))) == [4, 0]


def test_longest_prefix_stops_at_first_miss() -> None:
    index = PrefixIndex(3)
    h = chain(list(range(20)))
    l0, l1 = index.listener(0), index.listener(1)
    for x in h:
        l0.on_block_cached(x)
    # Rank 1 holds blocks 0, 1 and 3 but not 2: block 3 cannot count.
    for x in (h[0], h[1], h[3]):
        l1.on_block_cached(x)
    assert index.longest_prefix_hits(h) == [5, 2, 0]
    assert index.longest_prefix_hits([]) == [0, 0, 0]
    # Events are idempotent / tolerant, so counts cannot drift.
    l1.on_block_cached(h[0])
    l1.on_block_evicted(h[2])
    assert index.num_hashes(1) == 3
    index.clear_rank(0)
    assert index.longest_prefix_hits(h) == [0, 2, 0]
    assert (len(index), index.num_hashes(0)) == (3, 0)
    with pytest.raises(ValueError):
        index.listener(3)
    with pytest.raises(ValueError):
        PrefixIndex(0)


# ----------------------------------------------------- (b) prefix beats load


def test_shared_long_prefix_goes_to_the_rank_that_holds_it() -> None:
    index = PrefixIndex(2)
    m0, m1 = managers(index, num_blocks=32)
    router = DPRouter(2, BS, index)
    warm = make_request("warm", PREFIX + [1, 2])
    assert router.route(warm, [IDLE, IDLE]) == 0
    prefill(m0, warm)
    # Rank 1 holds only the first half of the prefix.
    prefill(m1, make_request("half", PREFIX[:16] + [7]))

    new = make_request("new", PREFIX + [50, 51, 52])
    assert router.prefix_hits(new) == [8, 4]
    # Rank 0 is far busier, yet the longer exact hit wins.
    assert router.route(new, [BUSY, IDLE]) == 0
    # ... and rank 0's own lookup finds exactly what the router promised.
    hits, num_hit = m0.get_computed_blocks(new)
    assert num_hit == 8 * BS and m0.get_block_ids("warm")[:8] == [b.block_id for b in hits]

    # The last token is never a hit, as in get_computed_blocks.
    exact = make_request("exact", list(PREFIX))
    assert router.prefix_hits(exact) == [7, 4]
    assert m0.get_computed_blocks(exact)[1] == 7 * BS
    # Equal hits on both ranks: load decides.
    short = make_request("short", PREFIX[:16] + [9, 9, 9])
    assert router.prefix_hits(short) == [4, 4]
    assert router.route(short, [BUSY, IDLE]) == 1
    # prompt_logprobs requests never use hits, so they route by load.
    plp = make_request("plp", PREFIX + [50], prompt_logprobs=0)
    assert router.prefix_hits(plp) == [0, 0]
    assert router.route(plp, [BUSY, IDLE]) == 1


# ------------------------------------------------ (c) eviction is forgotten


def test_index_forgets_evicted_prefix_and_routing_falls_back_to_load() -> None:
    index = PrefixIndex(2)
    m0, _ = managers(index, num_blocks=12)
    router = DPRouter(2, BS, index)
    warm = make_request("warm", PREFIX + [1, 2])
    assert prefill(m0, warm) == list(range(1, 10))
    m0.free(warm)
    new = make_request("new", PREFIX + [50])
    # Freed but still cached: still a hit.
    assert router.prefix_hits(new) == [8, 0]
    assert router.route(new, [BUSY, IDLE]) == 0

    # 11 blocks recycle the whole free queue, evicting every prefix block.
    filler = make_request("filler", list(range(5000, 5044)))
    assert prefill(m0, filler) == [10, 11] + list(range(9, 0, -1))
    assert all(index.ranks_holding(x) == frozenset() for x in chain(PREFIX))
    assert index.num_hashes(0) == 11
    assert router.prefix_hits(new) == [0, 0]
    assert router.route(new, [BUSY, IDLE]) == 1
    assert router.route(new, [IDLE, BUSY]) == 0
    assert m0.get_computed_blocks(new) == ([], 0)


# ------------------------------------------------------------ (d) tie-breaks


def test_ties_break_by_load_then_rank() -> None:
    index = PrefixIndex(4)
    router = DPRouter(4, BS, index)
    req = make_request("r", list(range(9)))
    loads = [
        RankLoad(10, 0.0),
        RankLoad(5, 0.9),
        RankLoad(5, 0.2),
        RankLoad(5, 0.2),
    ]
    # No hit anywhere: fewest queued tokens, then lowest KV usage, then lowest rank.
    assert router.route(req, loads) == 2
    assert router.route(req, [IDLE] * 4) == 0
    # Queued tokens outrank KV usage.
    assert router.route(req, [RankLoad(5, 0.0), RankLoad(4, 0.99), BUSY, BUSY]) == 1
    # Among equal hits (ranks 1 and 3), load decides; rank 2's lighter load is
    # irrelevant because it hits less.
    for r in (1, 3):
        for x in chain(list(range(8))):
            index.listener(r).on_block_cached(x)
    assert router.prefix_hits(req) == [0, 2, 0, 2]
    assert router.route(req, [IDLE, RankLoad(7, 0.1), IDLE, RankLoad(6, 0.5)]) == 3
    assert router.route(req, [IDLE, RankLoad(6, 0.5), IDLE, RankLoad(6, 0.5)]) == 1

    # Without an index (prefix caching off) the same request routes by load alone.
    plain = DPRouter(4, BS, None)
    assert plain.route(req, [IDLE, RankLoad(7, 0.1), IDLE, RankLoad(6, 0.5)]) == 0


def test_rank_load_definition_and_validation() -> None:
    waiting = make_request("w", list(range(10)))
    waiting.num_computed_tokens = 4  # e.g. preempted mid-prefill, or a prefix hit
    prefilling = make_request("p", list(range(12)))
    prefilling.num_computed_tokens = 5
    decoding = make_request("d", list(range(6)))
    decoding.append_output_token_ids([1, 2])
    decoding.num_computed_tokens = 7
    load = RankLoad.from_requests([waiting], [prefilling, decoding], kv_usage=0.25)
    assert load == RankLoad(num_queued_tokens=6 + 7 + 0, kv_usage=0.25)
    with pytest.raises(ValueError):
        RankLoad(-1, 0.0)
    with pytest.raises(ValueError):
        RankLoad(0, 1.5)
    router = DPRouter(2, BS, PrefixIndex(2))
    with pytest.raises(ValueError):
        router.route(waiting, [IDLE])
    with pytest.raises(ValueError):
        DPRouter(3, BS, PrefixIndex(2))


# ------------------------------------------------------- (e) reset forgets


def test_reset_prefix_cache_clears_only_that_rank() -> None:
    index = PrefixIndex(2)
    m0, m1 = managers(index, num_blocks=16)
    router = DPRouter(2, BS, index)
    a0 = make_request("a0", PREFIX + [1])
    a1 = make_request("a1", PREFIX + [1])
    prefill(m0, a0)
    prefill(m1, a1)
    new = make_request("new", PREFIX + [2])
    assert router.prefix_hits(new) == [8, 8]
    assert router.route(new, [IDLE, BUSY]) == 0

    # Refused while rank 0's blocks are owned: the index keeps its entries.
    assert m0.reset_prefix_cache() is False
    assert index.num_hashes(0) == 8
    m0.free(a0)
    assert m0.reset_prefix_cache() is True
    assert index.num_hashes(0) == 0
    assert all(index.ranks_holding(x) == frozenset({1}) for x in chain(PREFIX))
    assert router.prefix_hits(new) == [0, 8]
    assert router.route(new, [IDLE, BUSY]) == 1


# -------------------------------------------------------- (f) cache salt


def test_cache_salt_changes_routing() -> None:
    index = PrefixIndex(3)
    m0, m1, _ = managers(index, num_blocks=16)
    router = DPRouter(3, BS, index)
    prefill(m0, make_request("plain", PREFIX + [1]))
    prefill(m1, make_request("salted", PREFIX + [1], cache_salt="s"))
    loads = [BUSY, BUSY, IDLE]

    assert router.prefix_hits(make_request("n", PREFIX + [2])) == [8, 0, 0]
    assert router.route(make_request("n", PREFIX + [2]), loads) == 0
    assert router.prefix_hits(make_request("s", PREFIX + [2], cache_salt="s")) == [0, 8, 0]
    assert router.route(make_request("s", PREFIX + [2], cache_salt="s"), loads) == 1
    # An unseen salt hits nowhere: least load.
    other = make_request("t", PREFIX + [2], cache_salt="t")
    assert router.prefix_hits(other) == [0, 0, 0]
    assert router.route(other, loads) == 2
