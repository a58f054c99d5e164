"""The scheduler side of a second KV tier, as the KV cache manager calls it.

A tier's index lives with the scheduler (this protocol: which block hashes
it holds, what to store, what it evicted); its storage lives on every worker
(`rayvllm.kv_offload.tier.KVBlockStore`). Implementations are features
(`rayvllm.kv_offload`), built by the engine layer and injected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rayvllm.messages.block_hash import BlockHash


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
