"""Block pool, free queue and block hashing: exact ids, ref counts, eviction order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rayvllm
from rayvllm.core.block_pool import (
    BlockPool,
    FreeKVCacheBlockQueue,
    InsufficientBlocksError,
    KVCacheBlock,
)
from rayvllm.messages.block_hash import (
    ROOT_BLOCK_HASH,
    hash_block_tokens,
    hash_request_tokens,
    request_extra_keys,
)
from rayvllm.messages.engine_types import PrefixCacheStats


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


# ------------------------------------------------------------------ free queue


def test_free_queue_popleft_remove_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == 5
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]

    assert q.popleft() is blocks[0]
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    q.remove(blocks[2])  # middle
    q.remove(blocks[4])  # last
    assert ids(q.get_all_free_blocks()) == [1, 3]
    assert q.num_free_blocks == 2
    q.append(blocks[4])
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0]


def test_free_queue_popleft_n() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft_n(0) == []
    got = q.popleft_n(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert ids(q.get_all_free_blocks()) == [3]
    assert len(q) == 1
    with pytest.raises(InsufficientBlocksError):
        q.popleft_n(2)
    # The failed call changed nothing.
    assert ids(q.get_all_free_blocks()) == [3]
    assert ids(q.popleft_n(1)) == [3]
    assert len(q) == 0 and q.get_all_free_blocks() == []
    with pytest.raises(InsufficientBlocksError):
        q.popleft()
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [2]


def test_free_queue_rejects_misuse() -> None:
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    q.remove(blocks[0])
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not queued


def test_block_repr_does_not_recurse() -> None:
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])
    r = repr(q.get_all_free_blocks()[1])
    assert "id=1" in r and "prev=0" in r and "next=2" in r


# ------------------------------------------------------------------ block pool


def test_pool_null_block_and_initial_state() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, enable_caching=True)


def test_pool_allocate_and_free_order() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert ids(a) == [1, 2, 3]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.get_usage() == pytest.approx(3 / 5)
    with pytest.raises(InsufficientBlocksError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2

    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [4, 5, 3, 2, 1]
    assert [b.ref_cnt for b in a] == [0, 0, 0]
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        pool.free_blocks([a[0]])  # double free


def test_pool_touch_shares_and_revives() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    (b1,) = pool.get_new_blocks(1)
    pool.touch([b1])  # shared by a second owner
    assert b1.ref_cnt == 2
    pool.free_blocks([b1])
    assert b1.ref_cnt == 1 and 1 not in free_ids(pool)
    pool.free_blocks([b1])
    assert b1.ref_cnt == 0 and free_ids(pool) == [2, 3, 4, 1]
    pool.touch([b1])  # revive a free block: leaves the queue
    assert b1.ref_cnt == 1 and free_ids(pool) == [2, 3, 4]


def test_pool_cache_lookup_and_eviction() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    hashes = hash_request_tokens(2, [1, 2, 3, 4, 5, 6])
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_cached_block(hashes[2]) is None  # beyond num_full_blocks
    assert blocks[2].block_hash is None

    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    # Free but still cached.
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    # Reusing block 3 (uncached) evicts nothing; block 2 is evicted next.
    assert ids(pool.get_new_blocks(1)) == [3]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(hashes[1]) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_pool_duplicate_hashes() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = hash_request_tokens(2, [7, 7])
    x, y = pool.get_new_blocks(2)
    pool.cache_full_blocks([x], h, 0, 1)
    pool.cache_full_blocks([y], h, 0, 1)
    assert pool.get_cached_block(h[0]) is x  # first registered wins
    pool.free_blocks([x, y])
    assert ids(pool.get_new_blocks(2)) == [3, 1]  # evicts x
    assert pool.get_cached_block(h[0]) is y
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(h[0]) is None
    assert pool.cached_block_hash_to_block == {}


def test_pool_cache_full_blocks_skips_already_cached() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens(1, [1, 2])
    pool.cache_full_blocks(blocks, hashes, 0, 1)
    pool.cache_full_blocks(blocks, hashes, 0, 2)  # block 0 already carries its hash
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert len(pool.cached_block_hash_to_block) == 2
    with pytest.raises(ValueError):
        pool.cache_full_blocks(blocks, hashes[:1], 1, 2)


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens(1, [1, 2])
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False  # blocks in use
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None
    assert all(b.block_hash is None for b in pool.blocks)


def test_pool_caching_disabled() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens(1, [1, 2])
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.get_cached_block(hashes[0]) is None
    assert all(b.block_hash is None for b in blocks)


# ----------------------------------------------------------------- hashing


def test_hash_chain_properties() -> None:
    toks = list(range(10))
    hs = hash_request_tokens(4, toks)
    assert len(hs) == 2  # partial tail block not hashed
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hs)
    assert hs[0] == hash_block_tokens(None, toks[:4])
    assert hs[0] == hash_block_tokens(ROOT_BLOCK_HASH, toks[:4])
    assert hs[1] == hash_block_tokens(hs[0], toks[4:8])
    # The same tokens after a different prefix hash differently.
    assert hash_request_tokens(4, [9, 9, 9, 9] + toks[4:8])[1] != hs[1]
    # Block contents matter, including order and length.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, [1]) != hash_block_tokens(None, [1, 0])
    assert hash_request_tokens(4, [1, 2, 3]) == []


def test_hash_extra_keys_and_salt() -> None:
    toks = list(range(8))
    plain = hash_request_tokens(4, toks)
    salted = hash_request_tokens(4, toks, request_extra_keys("s1"))
    other = hash_request_tokens(4, toks, request_extra_keys("s2"))
    assert request_extra_keys(None) is None
    assert len({plain[0], salted[0], other[0]}) == 3
    # The salt propagates down the chain.
    assert len({plain[1], salted[1], other[1]}) == 3
    assert hash_request_tokens(4, toks, request_extra_keys("s1")) == salted


def test_hash_reproducible_across_processes() -> None:
    code = (
        "from rayvllm.messages.block_hash import hash_request_tokens, request_extra_keys;"
        "print(hash_request_tokens(2, [5, 6, 7, 8], request_extra_keys('x'))[-1].hex())"
    )
    # Different PYTHONHASHSEEDs would change any hash built on Python's hash().
    repo_root = str(Path(rayvllm.__file__).resolve().parent.parent)
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": repo_root},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    here = hash_request_tokens(2, [5, 6, 7, 8], request_extra_keys("x"))[-1].hex()
    assert outs == {here}


def test_prefix_cache_stats() -> None:
    s = PrefixCacheStats(requests=2, queries=10, hits=4)
    assert s.hit_rate == pytest.approx(0.4)
    s.reset()
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)
    assert s.hit_rate == 0.0
