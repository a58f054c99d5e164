"""`EngineReplica`: one engine of a batch job as a long-lived async Ray
actor, the thin shim over `RowRunner` (runner.py). Its engine runs in the
actor's process (`AsyncLLM` in-process), or, with a parallel size above 1
or the Ray backend, in a SchedulerActor and worker actors of its own,
placed in the bundles its feeder reserved (`ReplicaPlacement`).

A replica whose engine died exits its process, so that Ray restarts it
(`max_restarts`) with a fresh engine and its feeders resubmit the rows it
held (feeder.py); a dead engine must never answer as if alive.

Its engine's metrics go to Ray's Prometheus endpoint (actors/ray_metrics.py)
every `METRICS_EXPORT_INTERVAL_S` while it processes rows, tagged with the
replica's actor name: a batch job has no `/metrics` of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayvllm.actors.niceness import lower_to_zero, rank_runtime_env
from rayvllm.actors.placement import deployment_bundles, worker_bundles
from rayvllm.data.config import EngineProcessorConfig
from rayvllm.data.rows import RowStages
from rayvllm.messages.errors import EngineDeadError, PlacementError

if TYPE_CHECKING:
    from rayvllm.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

# Replicas are named actors (`ray list actors` shows them by this prefix).
REPLICA_NAME_PREFIX = "rayvllm-data-replica-"
# Ray's own agents report every 10 s by default; more often would only
# overwrite gauges nobody has read.
METRICS_EXPORT_INTERVAL_S = 5.0


class ReplicaPlacement:
    """Where a feeder's replica runs, as Serve places an `LLMServer`
    replica. An engine in the actor's process: the actor takes its one
    worker's resources. An engine on Ray: a placement group laid out by
    `deployment_bundles` (the replica's bundle, then every worker group's),
    owned by the feeder, the replica in bundle 0 and the engine's actors in
    the others (`reserved_pg`); removing the group (`release`) ends them
    all, even after the replica died without stopping its engine.

    The replica is restarted by Ray without limit; the feeder bounds the
    retries per batch instead (`max_batch_retries`)."""

    def __init__(self, config: EngineProcessorConfig) -> None:
        args = config.engine_args()
        parallel = args.create_parallel_config()
        device = _placement_device(args.device)
        self.options: dict[str, Any] = {
            "runtime_env": rank_runtime_env(config.runtime_env), "max_restarts": -1, "max_task_retries": 0,
        }
        self.pg: PlacementGroup | None = None
        if not parallel.use_ray:
            bundle = worker_bundles(parallel, device)[0]
            self.options.update(num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0))
            return
        bundles = deployment_bundles(parallel, device)
        self.pg = placement_group(bundles, strategy=parallel.placement_group_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=parallel.placement_group_timeout_s)
        if not ready:
            self.release()
            raise PlacementError(
                f"an engine replica's placement group ({len(bundles)} bundles) was not placed within "
                f"{parallel.placement_group_timeout_s:g}s"
            )
        self.options.update(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, 0))

    def release(self) -> None:
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def _placement_device(device: str) -> str:
    """The device a replica's engine will take: `auto` is CUDA where the
    cluster has GPUs (the engine, placed on a GPU, then finds CUDA). Read
    from Ray's resources rather than torch's, which a feeder, running no
    model, never imports."""
    if device != "auto":
        return device
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def start_replica(config: EngineProcessorConfig, placement: ReplicaPlacement) -> Any:
    """A new named replica (not yet answering: its engine builds in its constructor)."""
    name = f"{REPLICA_NAME_PREFIX}{uuid.uuid4().hex[:12]}"
    options = {"name": name, **placement.options}
    return EngineReplica.options(**options).remote(config, placement.pg)  # type: ignore[attr-defined]


@ray.remote
class EngineReplica:
    def __init__(self, config: EngineProcessorConfig, reserved_pg: PlacementGroup | None) -> None:
        lower_to_zero()
        # The engine's modules (torch among them) are imported here, in the
        # replica's process: the feeders import this module to start
        # replicas, and they run no model.
        from rayvllm.actors.factory import async_llm_from_engine_args
        from rayvllm.actors.ray_metrics import RayMetricsExporter
        from rayvllm.data.runner import RowRunner

        self.engine: AsyncLLM = async_llm_from_engine_args(config.engine_args(), reserved_pg=reserved_pg)
        self.runner = RowRunner(
            self.engine, RowStages.of(config), config.task_type == "embed", config.max_pending_requests
        )
        name = ray.get_runtime_context().get_actor_name() or ray.get_runtime_context().get_actor_id()
        self.metrics = RayMetricsExporter(name)
        self._exporting: asyncio.Task[None] | None = None

    def export_metrics(self) -> int:
        """Set the engine's metrics on Ray's gauges now; how many samples."""
        return self.metrics.export(self.engine.metrics.families())

    async def _export_while_alive(self) -> None:
        while True:
            self.export_metrics()
            await asyncio.sleep(METRICS_EXPORT_INTERVAL_S)

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
        if self._exporting is None:
            self._exporting = asyncio.get_running_loop().create_task(self._export_while_alive())
        try:
            async for item in self.runner.run(rows):
                yield item
        except EngineDeadError:
            logger.exception("the replica's engine died; exiting so that Ray restarts the replica")
            os._exit(1)
