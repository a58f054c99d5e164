"""In-process executor: one ModelRunner in the engine's own process."""

from __future__ import annotations

from rayvllm.executor.base import Executor
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.model_executor.model_runner import ModelRunner
from rayvllm.worker.extensions import create_model_runner


class UniProcExecutor(Executor):
    runner: ModelRunner

    def initialize(self) -> int:
        self.runner = create_model_runner(self.config)
        self.runner.load_model()
        num_blocks = self.runner.determine_num_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if hasattr(self, "runner"):  # initialize() may have failed before it
            self.runner.shutdown()
