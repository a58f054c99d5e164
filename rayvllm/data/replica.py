"""`EngineReplica`: one engine of a batch job as a long-lived async Ray
actor, the thin shim over `RowRunner` (runner.py). Its engine runs in the
actor's process (`AsyncLLM` in-process), or, with a parallel size above 1
or the Ray backend, makes its own SchedulerActor and worker actors, which
share the replica's fate.

A replica whose engine died exits its process, so that Ray restarts it
(`max_restarts`) with a fresh engine and its feeders resubmit the rows it
held (feeder.py); a dead engine must never answer as if alive.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import ray

from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.actors.placement import HOT_PATH_RUNTIME_ENV, worker_bundles
from rayvllm.config.engine_args import EngineArgs
from rayvllm.data.config import EngineProcessorConfig
from rayvllm.data.rows import RowStages
from rayvllm.data.runner import RowRunner
from rayvllm.messages.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Replicas are named actors (`ray list actors` shows them by this prefix).
REPLICA_NAME_PREFIX = "rayvllm-data-replica-"


def replica_options(config: EngineProcessorConfig, args: EngineArgs) -> dict[str, Any]:
    """`EngineReplica.options(...)`: an engine in the actor's process takes
    its one worker's resources; one on Ray takes none (its actors reserve
    their own). Restarted without limit by Ray: the feeders bound the
    retries per batch instead (`max_batch_retries`)."""
    parallel = args.create_parallel_config()
    resources: dict[str, Any] = {"num_cpus": 0}
    if not parallel.use_ray:
        bundle = worker_bundles(parallel, args.resolve_device())[0]
        resources = {"num_cpus": bundle.get("CPU", 0.0), "num_gpus": bundle.get("GPU", 0.0)}
    env = dict(config.runtime_env or {})
    env["env_vars"] = {**HOT_PATH_RUNTIME_ENV["env_vars"], **env.get("env_vars", {})}
    return {**resources, "runtime_env": env, "max_restarts": -1, "max_task_retries": 0}


def start_replica(config: EngineProcessorConfig, options: dict[str, Any]) -> Any:
    """A new named replica (not yet answering: its engine builds in its constructor)."""
    name = f"{REPLICA_NAME_PREFIX}{uuid.uuid4().hex[:12]}"
    return EngineReplica.options(name=name, **options).remote(config)  # type: ignore[attr-defined]


@ray.remote
class EngineReplica:
    def __init__(self, config: EngineProcessorConfig) -> None:
        stages = RowStages(config.apply_chat_template, config.chat_template, config.tokenize, config.detokenize)
        self.engine = async_llm_from_engine_args(config.engine_args())
        self.runner = RowRunner(self.engine, stages, config.task_type == "embed", config.max_pending_requests)

    def pid(self) -> int:
        """This replica's process id (and, answered, that its engine is built)."""
        return os.getpid()

    async def wait_started(self, n: int) -> int:
        """Once `n` rows have been admitted to this engine: its process id."""
        await self.runner.wait_started(n)
        return os.getpid()

    @ray.method(num_returns="streaming")  # type: ignore[misc]
    async def process(self, rows: list[tuple[int, dict[str, Any]]]) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Each row's `(index, columns)` as it finishes (RowRunner.run)."""
        try:
            async for item in self.runner.run(rows):
                yield item
        except EngineDeadError:
            logger.exception("the replica's engine died; exiting so that Ray restarts the replica")
            os._exit(1)
