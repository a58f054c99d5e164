"""In-process executor: one worker (its ModelRunner) in the engine's own process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rayvllm.executor.base import Executor
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.model_executor.model_runner import ModelRunner
from rayvllm.worker.worker import Worker, create_worker


class UniProcExecutor(Executor):
    worker: Worker

    def initialize(self) -> int:
        self.worker = create_worker(self.config, 0)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    @property
    def runner(self) -> ModelRunner:
        assert self.worker.runner is not None
        return self.worker.runner

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return [self.worker.run_method(method, args, kwargs or {})]

    def shutdown(self) -> None:
        if hasattr(self, "worker"):  # initialize() may have failed before it
            self.worker.shutdown()
