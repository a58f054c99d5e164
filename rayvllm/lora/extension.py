"""LoRA on the runner's step: the target's projections get adapter slots
when the model loads; each step loads the adapters its new requests name
and sets the token-to-slot mask in batch order."""

from __future__ import annotations

from rayvllm.config.lora import LoRAConfig
from rayvllm.lora.model_manager import LoRAModelManager
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.extension_context import BeginStepContext, ModelLoadContext, PrepareInputsContext


class LoRAExtension(ModelRunnerExtension):
    """Runs on every rank of the group (each holds its shard of the adapters)."""

    # A step's adapter mask is not among a graph's static inputs.
    supports_cuda_graphs = False

    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self.manager: LoRAModelManager | None = None

    def load_model(self, ctx: ModelLoadContext) -> None:
        self.manager = LoRAModelManager(ctx.model, self.config, ctx.dtype, ctx.device, ctx.to_device)

    def begin_step(self, ctx: BeginStepContext) -> None:
        assert self.manager is not None
        self.manager.update(ctx.scheduler_output)

    def prepare_inputs(self, ctx: PrepareInputsContext) -> None:
        assert self.manager is not None
        self.manager.set_step([s.req_id for s in ctx.states], ctx.q_lens)
