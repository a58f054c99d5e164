"""The host-memory tier: an LRU of block hashes bounded in bytes on the
scheduler side (`HostKVTier`), and each worker's plain dict of shards
(`HostKVStore`). The index alone decides what is kept, and tells the
workers what to drop, so every TP/PP rank holds the same hashes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rayvllm.core.block_pool import BlockPoolListener
from rayvllm.messages.block_hash import BlockHash

if TYPE_CHECKING:
    import torch


class HostKVTier:
    """Invariant: at most `capacity_bytes // bytes_per_block` hashes are
    held; the least recently stored or hit is evicted first. `listener`
    hears each hash appear and disappear (`BlockPoolListener`'s contract),
    as the data-parallel prefix index needs."""

    name = "host"

    def __init__(
        self, capacity_bytes: int, bytes_per_block: int, listener: BlockPoolListener | None = None
    ) -> None:
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be > 0, got {bytes_per_block}")
        self.bytes_per_block = bytes_per_block
        self.listener = listener
        self.capacity_blocks = capacity_bytes // bytes_per_block
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self._drops: list[BlockHash] = []

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        lru = self._lru
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in lru:
                return i
            lru.move_to_end(block_hash)
        return len(block_hashes)

    def admit(self, block_hash: BlockHash) -> bool:
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return False
        if self.capacity_blocks == 0:
            return False
        lru[block_hash] = None
        if self.listener is not None:
            self.listener.on_block_cached(block_hash)
        while len(lru) > self.capacity_blocks:
            self._drop(lru.popitem(last=False)[0])
        return True

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            if self._lru.pop(block_hash, 0) is None:
                self._drop(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        self._drops.append(block_hash)
        if self.listener is not None:
            self.listener.on_block_evicted(block_hash)

    def take_drops(self) -> list[BlockHash]:
        drops, self._drops = self._drops, []
        return drops


class HostKVStore:
    """One worker's shards, in its own process's memory (pinned on CUDA, so
    loads copy to the device at full speed)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._blocks: dict[BlockHash, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> None:
        for block_hash, block in zip(block_hashes, blocks, strict=True):
            self._blocks[block_hash] = block.pin_memory() if self.pin else block

    def get(self, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        return [self._blocks.get(h) for h in block_hashes]

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            self._blocks.pop(block_hash, None)
