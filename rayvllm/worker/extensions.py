"""Which features a rank's model runner runs, chosen by the engine config:
the one place that knows both the runner and the feature packages."""

from __future__ import annotations

from rayvllm.config import EngineConfig
from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.kv_offload.extension import KVBlockIOExtension
from rayvllm.kv_offload.factory import offloads_kv
from rayvllm.lora.extension import LoRAExtension
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.model_runner import ModelRunner
from rayvllm.spec_decode.speculator import Speculator
from rayvllm.structured_output.extension import StructuredOutputExtension


def create_extensions(config: EngineConfig, parallel: ParallelContext) -> list[ModelRunnerExtension]:
    """In hook order: KV copies first (a step's forward reads what they
    load), adapters on every rank; then, where tokens are sampled,
    speculation before structured outputs (which advances its matchers
    over the tokens verification emits)."""
    extensions: list[ModelRunnerExtension] = []
    if offloads_kv(config):
        shard = parallel.pp_rank * parallel.tp_size + parallel.tp_rank
        extensions.append(KVBlockIOExtension(config, shard))
    if config.lora_config is not None:
        extensions.append(LoRAExtension(config.lora_config))
    if parallel.is_driver:
        spec = config.speculative_config
        if spec is not None:
            mc = config.model_config
            extensions.append(Speculator(spec, mc.max_model_len, mc.head_dim))
        # Grammar matchers live where tokens are sampled.
        extensions.append(StructuredOutputExtension(config.model_config))
    return extensions


def create_model_runner(config: EngineConfig, parallel: ParallelContext | None = None) -> ModelRunner:
    """A rank's runner with the features `config` enables."""
    parallel = parallel or ParallelContext()
    return ModelRunner(config, parallel, create_extensions(config, parallel))
