"""The physical KV-cache block pool: ref counts, an LRU free queue, and the
hash -> block map that makes freed blocks reusable as a prefix cache.

Life of a block:

* ``ref_cnt > 0``: owned by that many running requests; never in the free queue.
* ``ref_cnt == 0``: in the free queue. If it still carries a ``block_hash`` it
  is *cached*: a prefix lookup may revive it (``touch``) until it reaches the
  front of the queue and is handed out again, at which point it is evicted
  (its hash forgotten).

Block 0 is the null block: reserved at construction, never handed out, never
freed, never cached. Usable block ids are ``1 .. num_blocks - 1``.

An optional `BlockPoolListener` sees the set of cached hashes change (a hash
appears, a hash disappears), which is what a cross-pool prefix index needs to
route requests between data-parallel ranks without asking each pool.
An optional `on_evict(block)` callback sees each block whose hash's last
copy is about to be overwritten, while its KV is still intact: what a
second KV tier stores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from rayvllm.messages.block_hash import BlockHash


class BlockPoolListener(Protocol):
    """Observer of the *set of hashes* present in a pool's cached-block map.

    Contract, per pool: ``on_block_cached(h)`` fires when `h` goes from absent
    to present; ``on_block_evicted(h)`` fires when it goes from present to
    absent (its last block was evicted, or `reset_prefix_cache` dropped it).
    The two therefore alternate for any one hash, starting with "cached", and
    replaying them reproduces ``cached_block_hash_to_block.keys()`` exactly.
    A second block registered under a hash that is already present, or the
    eviction of one of several blocks sharing a hash, fires nothing.

    Callbacks run synchronously inside pool operations, on the scheduler's hot
    path: they must be cheap, must not raise, and must not call back into the
    pool.
    """

    def on_block_cached(self, block_hash: BlockHash) -> None: ...

    def on_block_evicted(self, block_hash: BlockHash) -> None: ...


class InsufficientBlocksError(RuntimeError):
    """More blocks were requested than the free queue holds.

    The KV cache manager checks capacity first and returns None instead, so
    seeing this means a caller skipped that check.
    """


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block (the tensors live on the workers).

    Invariants: ``ref_cnt >= 0``; the block is linked into the free queue
    (both ``prev_free_block`` and ``next_free_block`` set) iff ``ref_cnt == 0``
    and it is not the null block; ``block_hash`` is set only on full blocks
    registered in the pool's cached-block map.

    ``eq=False`` keeps identity semantics: two blocks are never "equal", and
    comparisons never walk the linked list.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        # The default repr would recurse through the neighbours' reprs.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h}, "
            f"prev={prev_id}, next={next_id})"
        )


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, in eviction order (front = evicted first).

    A ``collections.deque`` cannot remove from the middle in O(1), which is what
    a prefix hit on a free cached block needs; hence the intrusive links on
    ``KVCacheBlock``. Fake head and tail sentinels remove every empty/ends
    special case from the link surgery.

    Invariant: ``num_free_blocks`` equals the number of blocks between the
    sentinels; a block is in the queue iff its ``prev_free_block`` is not None.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block (the least recently freed)."""
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise InsufficientBlocksError("no free blocks left")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, front first. O(n)."""
        if n > self.num_free_blocks:
            raise InsufficientBlocksError(
                f"asked for {n} blocks, only {self.num_free_blocks} free"
            )
        out: list[KVCacheBlock] = []
        cur = self._head.next_free_block
        for _ in range(n):
            assert cur is not None and cur is not self._tail
            nxt = cur.next_free_block
            cur.prev_free_block = None
            cur.next_free_block = None
            out.append(cur)
            cur = nxt
        # Splice once instead of unlinking block by block.
        assert cur is not None
        self._head.next_free_block = cur
        cur.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from anywhere in the queue. O(1)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the back (evicted last). O(1)."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks front to back (O(n); for tests and debugging)."""
        out: list[KVCacheBlock] = []
        cur = self._head.next_free_block
        while cur is not None and cur is not self._tail:
            out.append(cur)
            cur = cur.next_free_block
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = None
        block.next_free_block = None
        self.num_free_blocks -= 1


class BlockPool:
    """All KV blocks of one cache, with ref counting and the prefix-cache map.

    Invariants: every non-null block is either in the free queue
    (``ref_cnt == 0``) or owned (``ref_cnt > 0``); ``cached_block_hash_to_block``
    holds exactly the blocks whose ``block_hash`` is set, keyed by that hash.
    Several blocks may share a hash (two requests computed the same prefix at
    the same time); a lookup returns the earliest registered one. If a
    `listener` is given, it is told whenever a key of that map appears or
    disappears (see `BlockPoolListener`).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        listener: BlockPoolListener | None = None,
        on_evict: Callable[[KVCacheBlock], None] | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block: KVCacheBlock = self.blocks[0]
        self.null_block.is_null = True
        # Never-used blocks come first in id order so allocation is predictable.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # hash -> {block_id: block}; the inner dict keeps insertion order, so
        # lookups are deterministic when duplicates exist.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.listener = listener
        self.on_evict = on_evict

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding `block_hash`'s KV, owned or free-but-cached, or None."""
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the front of the free queue, ref_cnt 1 each.

        Cached blocks popped here are evicted: their old content is about to be
        overwritten, so their hash must stop matching.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free cached ones."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        request_blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``request_blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``block_hashes[i]`` is the hash of the request's block ``i``; it must
        cover at least `num_full_blocks` entries. Blocks that already carry a
        hash (prefix hits) are left alone.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"need {num_full_blocks} block hashes, got {len(block_hashes)}"
            )
        table = self.cached_block_hash_to_block
        listener = self.listener
        for i in range(num_cached_blocks, num_full_blocks):
            block = request_blocks[i]
            if block.is_null:
                continue
            block_hash = block_hashes[i]
            if block.block_hash is not None:
                # A hit block reached via the same chain must hold the same hash.
                assert block.block_hash == block_hash, (block, i)
                continue
            block.block_hash = block_hash
            entry = table.get(block_hash)
            if entry is None:
                table[block_hash] = {block.block_id: block}
                if listener is not None:
                    listener.on_block_cached(block_hash)
            else:
                entry[block.block_id] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the back of
        the free queue in the order given (earlier = evicted sooner)."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached or not (all can be handed out)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks currently owned by requests."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is
        owned, since a running request's blocks may be mid-computation and a
        half-cleared map would be inconsistent with their hashes."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        listener = self.listener
        if listener is not None:
            for block_hash in self.cached_block_hash_to_block:
                listener.on_block_evicted(block_hash)
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                if self.on_evict is not None:
                    self.on_evict(block)
                del self.cached_block_hash_to_block[block_hash]
                if self.listener is not None:
                    self.listener.on_block_evicted(block_hash)
        block.block_hash = None
