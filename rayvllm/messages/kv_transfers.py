"""One step's KV movement between a rank's block pool and its second tier,
decided by the scheduler and carried out by every worker (see
`rayvllm.kv_offload`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayvllm.messages.block_hash import BlockHash


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
