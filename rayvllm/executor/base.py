"""The executor interface the engine core drives; local and Ray executors
implement it, and the engine cannot tell them apart."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from rayvllm.config import EngineConfig
from rayvllm.core.sched.output import SchedulerOutput
from rayvllm.worker.outputs import ModelRunnerOutput


class PendingOutput(Protocol):
    """A step submitted to the workers; `result()` waits for its output."""

    def result(self) -> ModelRunnerOutput: ...


class _Done:
    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def result(self) -> ModelRunnerOutput:
        return self.output


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def initialize(self) -> int:
        """Load the model, size and allocate the KV cache; returns the number
        of KV blocks (including the null block) every worker holds."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Submit a step without waiting. Invariant: steps reach the workers
        in submission order. The local executor simply runs it."""
        return _Done(self.execute_model(scheduler_output))

    def check_health(self) -> None:
        """Raise if any worker is dead."""

    def shutdown(self) -> None:
        pass


def create_executor(config: EngineConfig, dp_rank: int = 0) -> Executor:
    """The worker group of one data-parallel rank: Ray actors when any
    parallel size exceeds 1 or the Ray backend is asked for, else in-process."""
    if config.parallel_config.use_ray:
        from rayvllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, dp_rank)
    from rayvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
