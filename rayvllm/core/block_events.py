"""What an engine core tells its client about its prefix cache: the
routing keys of blocks its pools begin and stop caching (`BlockEvents`),
so a router outside the core can tell which replica holds which prefix.

`BlockEventLog` listens to every DP rank's pool and reports a key stored
when the first rank caches it and evicted when the last one drops it.
`ListenerFanout` lets a pool tell this log and the in-core DP router's
`PrefixIndex` alike.
"""

from __future__ import annotations

from collections import Counter

from rayvllm.core.block_pool import BlockPoolListener
from rayvllm.messages.block_hash import BlockHash, routing_key
from rayvllm.messages.engine_types import BlockEvents


class BlockEventLog:
    """Invariants: `_ranks[r]` is rank r's cached key set (each pool's
    listener contract makes its events alternate per hash); `_holders[k]`
    counts the ranks holding `k`; `_stored` / `_evicted` hold the keys that
    changed between none and some rank since the last `drain`, each at most
    in one of them."""

    def __init__(self, num_ranks: int) -> None:
        self._ranks: list[set[bytes]] = [set() for _ in range(num_ranks)]
        self._holders: Counter[bytes] = Counter()
        self._stored: set[bytes] = set()
        self._evicted: set[bytes] = set()
        self._reset = True

    def listener(self, rank: int) -> BlockPoolListener:
        return _RankEvents(self, rank)

    def cached(self, rank: int, block_hash: BlockHash) -> None:
        key = routing_key(block_hash)
        if key in self._ranks[rank]:
            return  # two hashes sharing a routing key: counted once
        self._ranks[rank].add(key)
        self._holders[key] += 1
        if self._holders[key] == 1:
            if key in self._evicted:
                self._evicted.discard(key)
            else:
                self._stored.add(key)

    def evicted(self, rank: int, block_hash: BlockHash) -> None:
        self._drop(rank, routing_key(block_hash))

    def _drop(self, rank: int, key: bytes) -> None:
        if key not in self._ranks[rank]:
            return
        self._ranks[rank].discard(key)
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            if key in self._stored:
                self._stored.discard(key)
            else:
                self._evicted.add(key)

    def clear_rank(self, rank: int) -> None:
        """Rank `rank`'s pool was replaced by an empty one (its workers
        died): its keys go as evictions where no other rank holds them."""
        for key in list(self._ranks[rank]):
            self._drop(rank, key)

    def drain(self) -> BlockEvents:
        events = BlockEvents(sorted(self._stored), sorted(self._evicted), self._reset)
        self._stored, self._evicted, self._reset = set(), set(), False
        return events


class _RankEvents:
    def __init__(self, log: BlockEventLog, rank: int) -> None:
        self._log = log
        self._rank = rank

    def on_block_cached(self, block_hash: BlockHash) -> None:
        self._log.cached(self._rank, block_hash)

    def on_block_evicted(self, block_hash: BlockHash) -> None:
        self._log.evicted(self._rank, block_hash)


class ListenerFanout:
    """One pool listener that tells several."""

    def __init__(self, *listeners: BlockPoolListener) -> None:
        self._listeners = listeners

    def on_block_cached(self, block_hash: BlockHash) -> None:
        for listener in self._listeners:
            listener.on_block_cached(block_hash)

    def on_block_evicted(self, block_hash: BlockHash) -> None:
        for listener in self._listeners:
            listener.on_block_evicted(block_hash)
