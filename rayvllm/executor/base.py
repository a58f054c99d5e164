"""The executor interface the engine core drives; local and Ray executors
implement it, and the engine cannot tell them apart."""

from __future__ import annotations

from abc import ABC, abstractmethod

from rayvllm.config import EngineConfig
from rayvllm.core.sched.output import SchedulerOutput
from rayvllm.worker.outputs import ModelRunnerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def initialize(self) -> int:
        """Load the model, size and allocate the KV cache; returns the number
        of KV blocks (including the null block) every worker holds."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None:
        """Raise if any worker is dead."""

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig) -> Executor:
    pc = config.parallel_config
    if pc.distributed_executor_backend == "ray" or pc.world_size > 1 or pc.data_parallel_size > 1:
        raise NotImplementedError(
            "the Ray executor (tensor/pipeline/data parallelism) is not available yet; "
            "use tensor_parallel_size=pipeline_parallel_size=data_parallel_size=1"
        )
    from rayvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
