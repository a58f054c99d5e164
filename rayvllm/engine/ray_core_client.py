"""The engine loop's handle on a `SchedulerActor`: the same methods as
`EngineCore`, so the loop cannot tell them apart (DESIGN principle 1).

Two direct channels to the actor (rpc_channel.py says why not Ray calls):
- Intake, one-way: every add and abort goes out the moment the caller makes
  it, from any thread, so the actor has it even while a step runs (see
  engine_core.py for how the core schedules it just in time).
- Steps: one round trip per step. The call carries how many intake messages
  were sent before it, and the actor waits for those, so a request added
  before a `step` is never later than that step.

Without async scheduling the round trip is pipelined: `step` takes the
reply of the call already in flight and at once sends the next one before
returning, so the loop's output processing (detokenizing, stop strings)
overlaps the next step's scheduling and forward instead of lengthening every
step. The price: a request added after that call went out waits for the
step after next, and an aborted request may emit one more output, which the
OutputProcessor drops (it no longer knows the id). With async scheduling
the actor already keeps the next step queued on the workers while it
answers, so `step` is one plain call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayvllm.actors.scheduler_actor import SchedulerActor
from rayvllm.config import EngineConfig, ParallelConfig
from rayvllm.distributed.rpc_channel import ChannelClient
from rayvllm.engine_types import EngineCoreOutput, SchedulerStats
from rayvllm.errors import EngineDeadError
from rayvllm.executor.placement import HOT_PATH_RUNTIME_ENV
from rayvllm.request import EngineCoreRequest


def ensure_ray_initialized(pc: ParallelConfig) -> None:
    """Join the Ray cluster this process can find (RAY_ADDRESS or a local
    `ray start`); otherwise start a local one with at least enough logical
    CPUs for every worker rank, oversubscribing a small machine on purpose
    (the ranks' torch threads are sized to the real cores)."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", log_to_driver=False)
        return
    except ConnectionError:
        pass
    needed = pc.data_parallel_size * pc.world_size * pc.num_cpus_per_worker
    ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), log_to_driver=False)


class RayEngineCoreClient:
    """`add_requests` and `abort_requests` may be called from any thread,
    also while another runs `step` (AsyncLLM calls them from its loop)."""

    def __init__(self, config: EngineConfig, reserved_pg: Any = None) -> None:
        """`reserved_pg`: the Serve replica's placement group (laid out by
        `deployment_bundles`): the actor goes in the replica's bundle, the
        workers in theirs, and Serve removes it all with the replica.
        Without it the actor runs beside the caller and each worker group
        makes its own placement group."""
        ensure_ray_initialized(config.parallel_config)
        if reserved_pg is not None:
            strategy: Any = PlacementGroupSchedulingStrategy(reserved_pg, placement_group_bundle_index=0)
        else:
            strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.actor: Any = SchedulerActor.options(
            scheduling_strategy=strategy,
            runtime_env=HOT_PATH_RUNTIME_ENV,
        ).remote()
        try:
            config.cache_config.num_blocks = ray.get(self.actor.start.remote(config, reserved_pg))
            step_end, intake_end = ray.get(self.actor.open_channels.remote())
            self.channel = ChannelClient(*step_end)
            self.intake_channel = ChannelClient(*intake_end)
        except BaseException:
            ray.kill(self.actor)
            raise
        self._intake_lock = threading.Lock()
        self._intake_sent = 0  # messages on the intake channel so far
        self._intake_stepped = 0  # of those, how many a step call has counted
        self._pipelined = not config.scheduler_config.async_scheduling
        # Invariants: at most one `step` call is unanswered on the channel
        # (`_inflight`), and `_ready` holds the outputs of one that was
        # answered while another call waited behind it; never both.
        self._inflight = False
        self._ready: list[EngineCoreOutput] | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send_intake("add_requests", list(requests))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = list(request_ids)
        if ids:
            self._send_intake("abort_requests", ids)
        return ids

    def _send_intake(self, method: str, payload: list[EngineCoreRequest] | list[str]) -> None:
        with self._intake_lock:
            try:
                self.intake_channel.send(method, payload)
            except OSError as e:
                raise EngineDeadError(f"the scheduler actor is gone: {e!r}") from e
            self._intake_sent += 1

    def has_pending_intake(self) -> bool:
        """Adds or aborts were sent that no step call has counted yet."""
        return self._intake_sent > self._intake_stepped

    def step(self) -> list[EngineCoreOutput]:
        try:
            if self._ready is not None:
                outputs, self._ready = self._ready, None
            else:
                if not self._inflight:
                    self._send_step()
                outputs = self._recv_step()
            if self._pipelined:
                self._send_step()
        except (EOFError, OSError) as e:
            raise EngineDeadError(f"the scheduler actor is gone: {e!r}") from e
        return outputs

    def _send_step(self) -> None:
        count = self._intake_sent
        self.channel.send("step", count)
        self._intake_stepped = count
        self._inflight = True

    def _recv_step(self) -> list[EngineCoreOutput]:
        self._inflight = False
        outputs: list[EngineCoreOutput] = self.channel.recv()
        return outputs

    def make_stats(self) -> SchedulerStats:
        """Stats as of the end of the step in flight."""
        try:
            self.channel.send("make_stats")
            if self._inflight:
                try:
                    self._ready = self._recv_step()
                finally:
                    stats = self.channel.recv()  # keeps the channel in step
                return stats
            return self.channel.recv()
        except (EOFError, OSError) as e:
            raise EngineDeadError(f"the scheduler actor is gone: {e!r}") from e

    def check_health(self) -> None:
        ray.get(self.actor.check_health.remote())

    def shutdown(self) -> None:
        if self.actor is None:
            return
        self.channel.close()
        self.intake_channel.close()
        try:
            ray.get(self.actor.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.actor)
            self.actor = None
