"""Global prefix index: which data-parallel ranks hold which cached block hashes.

Each DP rank has its own `BlockPool`; this index mirrors the union of their
cached-hash sets, fed by one `BlockPoolListener` per rank (`listener(rank)`).
The router asks it, for a new request's hash chain, how long a prefix each
rank could serve from its cache, without touching any pool.

Ranks are stored as bit masks (bit ``r`` set = rank ``r`` holds the hash), so
one dict lookup and one AND per block advance every rank's prefix walk at once.

A rank's own second KV tier (host memory, kv_offload/) reports through
`tier_listener(rank)` into bit ``num_ranks + r``: a block there is a copy
away, so for routing it counts as held. (The Ray tier is shared by every
rank, so it prefers none and reports nothing.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayvllm.core.block_pool import BlockPoolListener
from rayvllm.messages.block_hash import BlockHash


class PrefixIndex:
    """``block_hash -> ranks holding it``, kept in step with every rank's pool.

    Invariants: every stored mask is non-zero (a hash no rank holds is
    removed); bit ``r`` of ``_ranks[h]`` is set iff rank ``r``'s pool has
    ``h`` among its cached hashes, given that rank's pool was built with
    ``listener(r)`` and started empty (or was reset) when the listener was
    attached. ``_num_hashes[s]`` counts the hashes with bit ``s`` set (pool
    bits ``0 .. num_ranks - 1``, then the tiers' bits).
    """

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self._ranks: dict[BlockHash, int] = {}
        self._num_hashes: list[int] = [0] * (2 * num_ranks)

    def listener(self, rank: int) -> BlockPoolListener:
        """The adaptor to pass as ``listener=`` to rank `rank`'s pool."""
        self._check_rank(rank)
        return _RankListener(self, rank, 1 << rank)

    def tier_listener(self, rank: int) -> BlockPoolListener:
        """The adaptor for rank `rank`'s own second KV tier (its hashes
        appear and disappear as the tier stores and evicts them)."""
        self._check_rank(rank)
        slot = self.num_ranks + rank
        return _RankListener(self, slot, 1 << slot)

    # ------------------------------------------------------------------ queries

    def longest_prefix_hits(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """For each rank, how many *leading* hashes of the chain it holds
        in its pool or its own tier.

        The walk for a rank stops at its first miss: hashes chain, so a later
        block cannot be served without the earlier ones even if present.
        Costs one dict lookup per block until every rank has missed.
        """
        n = self.num_ranks
        all_ranks = (1 << n) - 1
        hits = [len(block_hashes)] * n
        alive = all_ranks
        table = self._ranks
        for i, block_hash in enumerate(block_hashes):
            mask = table.get(block_hash, 0)
            still = alive & (mask | mask >> n)
            dropped = alive & ~still
            while dropped:
                low = dropped & -dropped
                hits[low.bit_length() - 1] = i
                dropped ^= low
            alive = still
            if not alive:
                break
        return hits

    def ranks_holding(self, block_hash: BlockHash) -> frozenset[int]:
        """The ranks whose pools (not tiers) currently cache `block_hash`."""
        mask = self._ranks.get(block_hash, 0)
        return frozenset(r for r in range(self.num_ranks) if mask >> r & 1)

    def num_hashes(self, rank: int) -> int:
        """How many distinct hashes rank `rank` currently caches."""
        self._check_rank(rank)
        return self._num_hashes[rank]

    def __len__(self) -> int:
        """Distinct hashes cached by at least one rank's pool or tier."""
        return len(self._ranks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._ranks

    # ---------------------------------------------------------------- mutation

    def clear_rank(self, rank: int) -> None:
        """Forget everything rank `rank` held in its pool and its tier, e.g.
        when they are replaced by fresh ones after a failure (a new pool
        sends no evictions for the old pool's hashes). O(len(self))."""
        self._check_rank(rank)
        tier_slot = self.num_ranks + rank
        bits = 1 << rank | 1 << tier_slot
        table = self._ranks
        for block_hash in [h for h, m in table.items() if m & bits]:
            remaining = table[block_hash] & ~bits
            if remaining:
                table[block_hash] = remaining
            else:
                del table[block_hash]
        self._num_hashes[rank] = self._num_hashes[tier_slot] = 0

    def _add(self, block_hash: BlockHash, rank: int, bit: int) -> None:
        mask = self._ranks.get(block_hash, 0)
        # Idempotent, so a duplicate event cannot skew the per-rank count.
        if not mask & bit:
            self._ranks[block_hash] = mask | bit
            self._num_hashes[rank] += 1

    def _remove(self, block_hash: BlockHash, rank: int, bit: int) -> None:
        mask = self._ranks.get(block_hash, 0)
        # Tolerate unknown hashes (e.g. after clear_rank): the pool must never
        # see an exception from its listener.
        if not mask & bit:
            return
        mask &= ~bit
        if mask:
            self._ranks[block_hash] = mask
        else:
            del self._ranks[block_hash]
        self._num_hashes[rank] -= 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")


@dataclass(frozen=True, slots=True)
class _RankListener:
    """Forwards one rank's pool (or tier) events to the shared index;
    `rank` is the slot counted, `bit == 1 << rank`."""

    index: PrefixIndex
    rank: int
    bit: int

    def on_block_cached(self, block_hash: BlockHash) -> None:
        self.index._add(block_hash, self.rank, self.bit)

    def on_block_evicted(self, block_hash: BlockHash) -> None:
        self.index._remove(block_hash, self.rank, self.bit)
