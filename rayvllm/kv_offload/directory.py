"""`KVTierDirectory`: the Ray object store tier's one directory per model
and KV layout, shared by every DP rank and Serve replica that serves it.

Block hash -> one object reference per group rank (the rank's shard).
Workers hand their shards to `register`, which stores them itself with the
`put` it was given: run as an actor with `ray.put` (`ray_tier.py`), the
directory owns every object (Ray 2.56 removed `ray.put(..., _owner=...)`,
the way to hand ownership over without the bytes passing through), so the
objects outlive the worker that stored them and live exactly as long as
the directory keeps them: dropping an entry frees its objects. Bounded in
bytes; least recently stored or hit goes first. Plain Python: the Ray
layer makes it remote.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np


class KVTierDirectory:
    """Invariants: `_bytes` is the sum of `_entry_bytes`; an entry counts as
    held (for `lookup`) only once all `num_shards` shards are registered.
    `put` stores a shard's bytes and returns the reference `get_refs`
    hands out (an ObjectRef under Ray)."""

    def __init__(self, capacity_bytes: int, num_shards: int, put: Callable[[np.ndarray], Any]) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_shards = num_shards
        self._put = put
        self._entries: OrderedDict[bytes, dict[int, Any]] = OrderedDict()
        self._entry_bytes: dict[bytes, int] = {}
        self._bytes = 0
        self.num_evictions = 0

    def __repr__(self) -> str:
        return f"KVTierDirectory(shards={self.num_shards})"

    def register(self, items: list[tuple[bytes, int, np.ndarray]]) -> None:
        """(hash, shard, bytes of the shard) per stored shard."""
        for block_hash, shard, raw in items:
            entry = self._entries.get(block_hash)
            if entry is None:
                entry = self._entries[block_hash] = {}
                self._entry_bytes[block_hash] = 0
            if shard in entry:
                continue  # another rank or replica stored the same block first
            entry[shard] = self._put(raw)
            self._entry_bytes[block_hash] += raw.nbytes
            self._bytes += raw.nbytes
            self._entries.move_to_end(block_hash)
        while self._bytes > self.capacity_bytes and self._entries:
            self._drop(next(iter(self._entries)))
            self.num_evictions += 1

    def lookup(self, block_hashes: list[bytes]) -> int:
        """How many leading hashes have every shard stored."""
        for i, block_hash in enumerate(block_hashes):
            entry = self._entries.get(block_hash)
            if entry is None or len(entry) < self.num_shards:
                return i
            self._entries.move_to_end(block_hash)
        return len(block_hashes)

    def get_refs(self, block_hashes: list[bytes], shard: int) -> list[list[Any]]:
        """Per hash, `[ref]` of the shard, or `[]` when it is not held."""
        out: list[list[Any]] = []
        for block_hash in block_hashes:
            ref = self._entries.get(block_hash, {}).get(shard)
            out.append([ref] if ref is not None else [])
        return out

    def forget(self, block_hashes: list[bytes]) -> None:
        """Entries whose objects a worker could not read (lost)."""
        for block_hash in block_hashes:
            if block_hash in self._entries:
                self._drop(block_hash)

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._entries), "bytes": self._bytes, "evictions": self.num_evictions}

    def _drop(self, block_hash: bytes) -> None:
        del self._entries[block_hash]
        self._bytes -= self._entry_bytes.pop(block_hash)
