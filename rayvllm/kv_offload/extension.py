"""The second KV tier on the runner's step: a rank's copies between its
caches and the tier's store, run before the step's forward reads them."""

from __future__ import annotations

import torch

from rayvllm.config import EngineConfig
from rayvllm.kv_offload.block_io import KVBlockIO
from rayvllm.kv_offload.factory import create_kv_block_io
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.extension_context import BeginStepContext


class KVBlockIOExtension(ModelRunnerExtension):
    """Group rank `shard`'s side of the tier (pp_rank * tp_size + tp_rank);
    runs on every rank, each copying its own shard of a block."""

    def __init__(self, config: EngineConfig, shard: int) -> None:
        self.config = config
        self.shard = shard
        self.block_io: KVBlockIO | None = None

    def initialize_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.block_io = create_kv_block_io(self.config, self.shard, kv_caches)

    def begin_step(self, ctx: BeginStepContext) -> None:
        transfers = ctx.scheduler_output.kv_transfers
        if transfers and self.block_io is not None:
            ctx.kv_load_failures.extend(self.block_io.apply(transfers))
