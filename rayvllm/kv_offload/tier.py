"""The two halves of a second KV tier, and one step's transfers between them.

A tier has an *index* on the scheduler side (`KVTier`: which block hashes
it holds, what to store, what it evicted) and *storage* on every worker
(`KVBlockStore`: the bytes of that worker's shard of each block). The
scheduler side decides; the workers carry out a step's `KVTransfers` before
its forward. Loads may fail (an object store lost the object): the workers
report the blocks, which are then recomputed, never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rayvllm.core.kv_cache_utils import BlockHash


@dataclass
class KVTransfers:
    """One step's data movement for one DP rank's worker group, done by each
    worker on its own shard before the step's forward, in this order:

    1. `stores`: (block id, hash) of cached blocks the pool is handing out
       again this step; copied out before the step overwrites them.
    2. `loads`: (block id, hash) of fresh blocks to fill from the tier (a
       block just stored in step 1 may be a load target: hence the order).
    3. `drops`: hashes the tier evicted; their storage is freed.

    `load_req_ids`: the requests whose loads this step carries."""

    stores: list[tuple[int, BlockHash]] = field(default_factory=list)
    loads: list[tuple[int, BlockHash]] = field(default_factory=list)
    drops: list[BlockHash] = field(default_factory=list)
    load_req_ids: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.drops)


class KVTier(Protocol):
    """The scheduler side of a tier. `name` labels its metrics;
    `bytes_per_block`: one block's KV over the whole worker group."""

    name: str
    bytes_per_block: int

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of the chain the tier holds (a hit also
        makes them recently used)."""
        ...

    def admit(self, block_hash: BlockHash) -> bool:
        """A block with this hash is leaving the pool: True when the workers
        should store it (False: already held, or no room)."""
        ...

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        """These hashes failed to load: stop offering them."""
        ...

    def take_drops(self) -> list[BlockHash]:
        """Hashes evicted since the last call, for the workers to free."""
        ...


class KVBlockStore(Protocol):
    """The worker side of a tier: this worker's shard of each block, as one
    flat host tensor per block."""

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> None: ...

    def get(self, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """The stored shards, None for each one that is gone."""
        ...

    def drop(self, block_hashes: Sequence[BlockHash]) -> None: ...
