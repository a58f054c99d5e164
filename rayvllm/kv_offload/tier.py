"""The worker side of a second KV tier.

A tier has an *index* on the scheduler side (`rayvllm.core.kv_tier.KVTier`:
which block hashes it holds, what to store, what it evicted) and *storage*
on every worker (`KVBlockStore`: the bytes of that worker's shard of each
block). The scheduler side decides; the workers carry out a step's
`rayvllm.messages.kv_transfers.KVTransfers` before its forward. Loads may
fail (an object store lost the object): the workers report the blocks,
which are then recomputed, never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from rayvllm.messages.block_hash import BlockHash

if TYPE_CHECKING:
    import torch


class KVBlockStore(Protocol):
    """The worker side of a tier: this worker's shard of each block, as one
    flat host tensor per block."""

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> None: ...

    def get(self, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        """The stored shards, None for each one that is gone."""
        ...

    def drop(self, block_hashes: Sequence[BlockHash]) -> None: ...
