"""The engine core: scheduler + executor, one `step()` per model forward."""

from __future__ import annotations

from collections.abc import Iterable

from rayvllm.config import EngineConfig
from rayvllm.core.sched.scheduler import Scheduler, SchedulerStats
from rayvllm.engine.core_output import EngineCoreOutput
from rayvllm.executor.base import Executor, create_executor
from rayvllm.request import EngineCoreRequest, Request


class EngineCore:
    """Token ids in, token ids out. Invariant: the scheduler's view of every
    request and the workers' are updated by the same `SchedulerOutput`."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or create_executor(config)
        num_blocks = self.executor.initialize()
        needed = -(-config.model_config.max_model_len // config.cache_config.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks - 1} blocks of {config.cache_config.block_size} tokens, "
                f"fewer than one max_model_len={config.model_config.max_model_len} sequence needs "
                f"({needed - 1}); raise the KV cache budget or lower max_model_len"
            )
        config.cache_config.num_blocks = num_blocks
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(request))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.finished_req_ids:
            return []
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
