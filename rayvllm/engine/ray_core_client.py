"""The engine loop's handle on a `SchedulerActor`: the same methods as
`EngineCore`, so the loop cannot tell them apart (DESIGN principle 1).

New requests and aborts are buffered and travel with the next `step` call,
so a step costs the loop one round trip, on a direct channel to the actor
rather than a Ray call (rpc_channel.py says why).

Without async scheduling the round trip is pipelined: `step` takes the
reply of the call already in flight and at once sends the next one before
returning, so the loop's output processing (detokenizing, stop strings)
overlaps the next step's scheduling and forward instead of lengthening every
step. The price is one step of latency for what the loop adds afterwards: a
request added or aborted after a `step` reaches the core with the step after
next, and an aborted request may emit one more output, which the
OutputProcessor drops (it no longer knows the id).

With async scheduling the SchedulerActor already keeps the next step queued
on the workers while it answers, so the workers never wait for the loop;
pipelining the calls as well would only queue every new request behind one
more step (measured: TTFT up by a step). Then `step` is one plain call, sent
no earlier than the actor's reply asked (`EngineCore.next_step_delay`, the
StepPacer): shortly before the worker finishes the step it runs, so requests
that arrive meanwhile make the next step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayvllm.actors.scheduler_actor import SchedulerActor
from rayvllm.config import EngineConfig, ParallelConfig
from rayvllm.core.sched.scheduler import SchedulerStats
from rayvllm.distributed.rpc_channel import ChannelClient
from rayvllm.engine.core_output import EngineCoreOutput
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
    def __init__(self, config: EngineConfig) -> None:
        ensure_ray_initialized(config.parallel_config)
        node = ray.get_runtime_context().get_node_id()
        self.actor: Any = SchedulerActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True),
            runtime_env=HOT_PATH_RUNTIME_ENV,
        ).remote()
        try:
            config.cache_config.num_blocks = ray.get(self.actor.start.remote(config))
            self.channel = ChannelClient(*ray.get(self.actor.open_channel.remote()))
        except BaseException:
            ray.kill(self.actor)
            raise
        self._new: list[list[EngineCoreRequest]] = []
        self._aborts: list[str] = []
        self._pipelined = not config.scheduler_config.async_scheduling
        # Invariants: at most one `step` call is unanswered on the channel
        # (`_inflight`), and `_ready` holds the outputs of one that was
        # answered while another call waited behind it; never both.
        self._inflight = False
        self._ready: list[EngineCoreOutput] | None = None
        self._send_at = 0.0  # monotonic time before which no step call is sent
        self.held_s = 0.0  # total time step calls were held for pacing
        # Called (on the stepping thread) right before a step is sent, so a
        # caller can hand over requests that arrived while it waited.
        self.before_send: Callable[[], None] | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._new.append([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._new.append(list(requests))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = list(request_ids)
        self._aborts += ids
        return ids

    def step(self) -> list[EngineCoreOutput]:
        try:
            if self._ready is not None:
                outputs, self._ready = self._ready, None
            else:
                if not self._inflight:
                    hold = self._send_at - time.monotonic()
                    if hold > 0.0:
                        time.sleep(hold)
                        self.held_s += hold
                    self._send_step()
                outputs = self._recv_step()
            if self._pipelined:
                self._send_step()
        except (EOFError, OSError) as e:
            raise EngineDeadError(f"the scheduler actor is gone: {e!r}") from e
        return outputs

    def _send_step(self) -> None:
        if self.before_send is not None:
            self.before_send()
        new, aborts = self._new, self._aborts
        self._new, self._aborts = [], []
        self.channel.send("step", new, aborts)
        self._inflight = True

    def _recv_step(self) -> list[EngineCoreOutput]:
        self._inflight = False
        outputs, delay = self.channel.recv()
        self._send_at = time.monotonic() + delay
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
        try:
            ray.get(self.actor.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.actor)
            self.actor = None
