"""The executor interface the engine core drives; local and Ray executors
implement it, and the engine cannot tell them apart."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from rayvllm.config import EngineConfig
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.scheduler_output import SchedulerOutput


class PendingOutput(Protocol):
    """A step submitted to the workers; `result()` waits for its output.
    `done()`: `result()` would not block. `wait_handles()`: objects that
    `multiprocessing.connection.wait` can wait on until it is done (none when
    it is done already)."""

    def result(self) -> ModelRunnerOutput: ...

    def done(self) -> bool: ...

    def wait_handles(self) -> list[Any]: ...


class _Done:
    """A step run at submission: its output, or the exception it raised
    (re-raised by `result`, where a remote step's failure surfaces too)."""

    def __init__(self, output: ModelRunnerOutput | None, error: Exception | None = None) -> None:
        self.output = output
        self.error = error

    def result(self) -> ModelRunnerOutput:
        if self.error is not None:
            raise self.error
        assert self.output is not None
        return self.output

    def done(self) -> bool:
        return True

    def wait_handles(self) -> list[Any]:
        return []


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
        try:
            return _Done(self.execute_model(scheduler_output))
        except Exception as e:  # noqa: BLE001 - reported with the step, by `result`
            return _Done(None, e)

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Call `method` on every worker of the group (`Worker.run_method`:
        a worker method's name, or a function given the worker first) and
        return each rank's result, in rank order. Called only while no step
        is in flight (the engine loop quiesces first). Raises the first
        rank's error as it was raised there."""
        raise NotImplementedError(f"{type(self).__name__} has no workers to call")

    def check_health(self) -> None:
        """Raise if any worker is dead."""

    def shutdown(self) -> None:
        pass


# A new, uninitialised worker group for a data-parallel rank. The layer
# that knows Ray (rayvllm.actors) decides local or Ray and hands it down.
ExecutorFactory = Callable[[int], Executor]
