"""A worker's side of the tier's transfers: copies between its paged KV
caches and its `KVBlockStore`, batched per step.

Every layout in kernels/kv_layout.py puts the block first, so one block's
shard is row `b` of each layer's key and value cache; a stored block is
those rows, flattened and concatenated in layer order (keys before values).
"""

from __future__ import annotations

import torch

from rayvllm.kv_offload.tier import KVBlockStore
from rayvllm.messages.kv_transfers import KVTransfers


class KVBlockIO:
    """Runs `KVTransfers` against `kv_caches` (one (key, value) pair per
    layer of this rank, as the model runner binds them)."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], store: KVBlockStore) -> None:
        self.caches = [cache for pair in kv_caches for cache in pair]
        self.store = store
        self.device = self.caches[0].device
        self.block_numel = sum(cache[0].numel() for cache in self.caches)

    @torch.inference_mode()
    def apply(self, transfers: KVTransfers) -> list[int]:
        """Stores, then loads, then drops (see `KVTransfers`); returns the
        block ids whose load failed (their contents are undefined)."""
        if transfers.stores:
            block_ids, hashes = zip(*transfers.stores)
            rows = self.gather(list(block_ids))
            self.store.put(hashes, [row.clone() for row in rows])
        failed: list[int] = []
        if transfers.loads:
            block_ids, hashes = zip(*transfers.loads)
            ok_ids: list[int] = []
            ok_rows: list[torch.Tensor] = []
            for block_id, row in zip(block_ids, self.store.get(hashes)):
                if row is None or row.numel() != self.block_numel:
                    failed.append(block_id)
                else:
                    ok_ids.append(block_id)
                    ok_rows.append(row)
            if ok_ids:
                self.scatter(ok_ids, torch.stack(ok_rows))
        if transfers.drops:
            self.store.drop(transfers.drops)
        return failed

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """`[len(block_ids), block_numel]` on the host: the blocks' shards."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        parts = [cache.index_select(0, index).reshape(len(block_ids), -1) for cache in self.caches]
        return torch.cat(parts, dim=1).cpu()

    def scatter(self, block_ids: list[int], rows: torch.Tensor) -> None:
        """Write `rows` (as `gather` returns them) into the blocks."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        rows = rows.to(self.device, non_blocking=True)
        offset = 0
        for cache in self.caches:
            numel = cache[0].numel()
            cache.index_copy_(0, index, rows[:, offset : offset + numel].reshape(len(block_ids), *cache.shape[1:]))
            offset += numel
