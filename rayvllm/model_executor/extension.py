"""The worker-side extension protocol: how a feature (LoRA, speculative
decoding, structured outputs, KV copies to a second tier) joins a
`ModelRunner` without the runner knowing it.

The runner calls each hook on every extension it was given, in the order
it was given them; a hook sees only its context (extension_context.py),
never the runner. The runner imports no feature: whoever builds it (the
Worker) chooses the extensions, and orders them so that an extension that
reads what another writes into a context comes after it.

Hooks, in the order of one runner's life:
  load_model          the target model is loaded (wrap its layers, load a second model)
  kv_cache_models     models beyond the target whose KV shares the target's blocks
  initialize_kv_cache the KV caches are bound, one (key, value) pair per layer
then per step (`execute_model`), on the runner's thread, in inference mode:
  begin_step          the persistent batch follows the scheduler output;
                      on every step, even one that schedules no token
  prepare_inputs      the step's batch layout is fixed; the forward follows
  before_sample       the step's logits exist (driver rank of a generating
                      model only); they may be edited in place
  after_sample        the sampling rows' tokens are drawn and appended
and once at the end: shutdown.
"""

from __future__ import annotations

import torch

from rayvllm.model_executor.extension_context import (
    BeginStepContext,
    LogitsContext,
    ModelLoadContext,
    PrepareInputsContext,
    SampleContext,
)
from rayvllm.models.interface import CausalLM


class ModelRunnerExtension:
    """A feature on the runner's step. Every hook is a no-op here; a
    feature overrides the ones it needs."""

    # False when the feature changes a step in a way a captured CUDA graph
    # cannot replay (its inputs are not among the graph's static inputs).
    supports_cuda_graphs: bool = True

    def load_model(self, ctx: ModelLoadContext) -> None:
        """After the target model is loaded, before the KV cache is sized."""

    def kv_cache_models(self) -> list[CausalLM]:
        """Models (loaded in `load_model`) whose KV this rank caches in the
        target's blocks: their layers count in a block's size and get
        caches of their own, bound after the target's."""
        return []

    def initialize_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every layer's bound (key, value) caches, target first, then the
        models of `kv_cache_models` in extension order."""

    def begin_step(self, ctx: BeginStepContext) -> None:
        """The step's scheduler output, after the persistent batch took its
        request changes and before anything of the step runs on the device."""

    def prepare_inputs(self, ctx: PrepareInputsContext) -> None:
        """The step's batch order and sampling rows, before its forward."""

    def before_sample(self, ctx: LogitsContext) -> None:
        """The step's logits, before any row is sampled or verified."""

    def after_sample(self, ctx: SampleContext) -> None:
        """The sampled tokens (already in the persistent batch)."""

    def shutdown(self) -> None:
        """Release threads and other resources; the runner is done."""
