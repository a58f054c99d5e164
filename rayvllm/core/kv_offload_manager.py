"""The scheduler side of offloading for one rank's block pool: what to
store when the pool evicts, which requests load from the tier, and the
step's `KVTransfers` that the workers carry out.

A load runs in its own step, before the request computes anything: the
request's pool hits are held, fresh blocks are allocated for the next
blocks the tier holds, and the step copies them in. When the step comes
back, the blocks that loaded are registered in the pool under their hashes
(the ones that failed are not, so they are recomputed) and all are freed:
they join the back of the free queue, evicted last, and the request, put
back at the front of the waiting queue, finds them as ordinary prefix hits.
Registering only after the copy means no other request can read a block
before its KV is there; holding blocks only while a copy runs means loads
can never keep the pool from the requests that run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayvllm.core.block_pool import BlockPool, KVCacheBlock
from rayvllm.core.kv_tier import KVTier
from rayvllm.messages.block_hash import BlockHash
from rayvllm.messages.engine_types import KVOffloadStats
from rayvllm.messages.kv_transfers import KVTransfers


@dataclass
class _Load:
    hit_blocks: list[KVCacheBlock]
    blocks: list[KVCacheBlock]
    hashes: list[BlockHash]


class KVOffloadManager:
    """Invariants: a request is in `loads` while its copy is in flight, and
    each block of its `_Load` holds one reference taken here. A request
    looks the tier up at most
    once until it is freed (finished or preempted), so a tier that keeps
    failing cannot keep it from being computed."""

    def __init__(self, tier: KVTier, block_pool: BlockPool, block_size: int) -> None:
        self.tier = tier
        self.pool = block_pool
        self.block_size = block_size
        self.loads: dict[str, _Load] = {}
        self._looked_up: set[str] = set()
        self._transfers = KVTransfers()
        self.stats = KVOffloadStats(tier=tier.name)

    def on_evict(self, block: KVCacheBlock) -> None:
        """The pool is handing out `block` again, its hash's last copy:
        store it unless the tier has it already."""
        block_hash = block.block_hash
        assert block_hash is not None
        if self.tier.admit(block_hash):
            self._transfers.stores.append((block.block_id, block_hash))
            self.stats.stores += 1

    def start_load(
        self, req_id: str, block_hashes: Sequence[BlockHash], hit_blocks: Sequence[KVCacheBlock], max_blocks: int
    ) -> bool:
        """Queue a load of the blocks after `hit_blocks` (up to `max_blocks`
        in all) that the tier holds; False (nothing done) when it holds
        none, the pool lacks room, or the request looked already. A request
        whose next block another request is loading already follows that
        load instead (it waits for a step after it, copying nothing)."""
        start = len(hit_blocks)
        if start >= max_blocks or req_id in self._looked_up:
            return False
        self._looked_up.add(req_id)
        wanted = block_hashes[start:max_blocks]
        self.stats.queries += len(wanted) * self.block_size
        pool = self.pool
        if any(wanted[0] in load.hashes for load in self.loads.values()):
            self._start(req_id, list(hit_blocks), [])
            return True
        num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.is_null)
        room = pool.get_num_free_blocks() - num_evictable_hits
        # The Ray tier's look-up is a call to its directory: not when futile.
        n = min(self.tier.lookup(wanted), room) if room > 0 else 0
        if n <= 0:
            return False
        self._start(req_id, list(hit_blocks), list(wanted[:n]))
        return True

    def _start(self, req_id: str, hit_blocks: list[KVCacheBlock], hashes: list[BlockHash]) -> None:
        """Hold the hits, allocate a block per hash and queue the copies."""
        self.pool.touch(hit_blocks)
        blocks = self.pool.get_new_blocks(len(hashes))
        self.loads[req_id] = _Load(hit_blocks, blocks, hashes)
        self._transfers.loads += [(b.block_id, h) for b, h in zip(blocks, hashes)]
        self._transfers.load_req_ids.append(req_id)

    def take_transfers(self) -> KVTransfers | None:
        """This step's transfers (None when there are none; a step that
        only carries requests following earlier loads is not empty)."""
        transfers = self._transfers
        drops = self.tier.take_drops()
        transfers.drops += drops
        self.stats.evictions += len(drops)
        if not transfers and not transfers.load_req_ids:
            return None
        self._transfers = KVTransfers()
        return transfers

    def finish(self, transfers: KVTransfers, failed_block_ids: Sequence[int]) -> list[str]:
        """A step with `transfers` came back; returns the requests whose
        loads are done (failed blocks left unregistered, to recompute)."""
        failed = set(failed_block_ids)
        done: list[str] = []
        bs = self.block_size
        for req_id in transfers.load_req_ids:
            load = self.loads.pop(req_id, None)
            if load is None:
                continue  # freed while its copy ran; its blocks are back in the pool
            lost: list[BlockHash] = []
            for block, block_hash in zip(load.blocks, load.hashes):
                if block.block_id in failed:
                    lost.append(block_hash)
                    continue
                self.pool.cache_full_blocks([block], [block_hash], 0, 1)
                self.stats.hits += bs
            if lost:
                self.tier.forget(lost)
                self.stats.load_failures += len(lost)
            self._free(load)
            done.append(req_id)
        return done

    def release(self, req_id: str) -> None:
        """The request is freed (finished, aborted or preempted): drop what
        is held for it; it may look the tier up again."""
        load = self.loads.pop(req_id, None)
        if load is not None:
            self._free(load)
        self._looked_up.discard(req_id)

    def _free(self, load: _Load) -> None:
        # Tail first, as KVCacheManager.free orders blocks.
        self.pool.free_blocks(reversed(load.hit_blocks + load.blocks))

    def make_stats(self) -> KVOffloadStats:
        """Counters since the previous call (bytes from block counts)."""
        stats = self.stats
        per_block = self.tier.bytes_per_block
        stats.bytes_stored = stats.stores * per_block
        stats.bytes_loaded = stats.hits // self.block_size * per_block
        self.stats = KVOffloadStats(tier=self.tier.name)
        return stats
