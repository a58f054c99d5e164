"""The client of a `SchedulerActor`'s engine loop (core_loop.py): the same
methods as the in-process client, so `AsyncLLM` cannot tell them apart
(docs/ARCHITECTURE.md, principle 1).

One direct connection (rpc_channel.py says why not Ray calls) carries both
ways: inputs go out the moment the caller makes them, from any thread, in
order; the loop pushes `EngineCoreOutputs` after every step on its own, so
`step` here only reads what was pushed, and the loop's next step already
runs while the caller processes the last one's outputs. Stats ride along
with every push; `make_stats` costs no round trip.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterable
from typing import Any

import ray

from rayvllm.actors.scheduler_actor import SchedulerActor
from rayvllm.config import EngineConfig, ParallelConfig
from rayvllm.distributed.rpc_channel import connect, hang_up
from rayvllm.executor.placement import remove_groups_made_by, remove_worker_placement_group, scheduler_actor_options
from rayvllm.messages.engine_types import (
    AbortRequests,
    AddRequests,
    EngineCoreFailure,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    KVOffloadStats,
    PrefixCacheStats,
    SchedulerStats,
)
from rayvllm.messages.errors import EngineDeadError, StepFailedError
from rayvllm.messages.request import EngineCoreRequest


# How long a failed engine's SchedulerActor gets to take its workers down
# before it is killed.
RESTART_SHUTDOWN_TIMEOUT_S = 10.0


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
    also while another is in `step`; `step` and `make_stats` from one."""

    def __init__(self, config: EngineConfig, reserved_pg: Any = None) -> None:
        """`reserved_pg`: the Serve replica's placement group (laid out by
        `deployment_bundles`): the actor and the workers go in its bundles,
        and Serve removes it all with the replica. Without it the engine
        makes its own groups. At world size 1 with one DP rank the actor
        runs the model itself (`scheduler_hosts_worker`)."""
        self.config = config
        self.reserved_pg = reserved_pg
        self._send_lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        """Start a SchedulerActor (and through it the workers), connect to
        its loop and read its first push."""
        pc = self.config.parallel_config
        ensure_ray_initialized(pc)
        options, self._pg = scheduler_actor_options(pc, self.config.device, self.reserved_pg)
        self.actor: Any = SchedulerActor.options(**options).remote()
        try:
            self.config.cache_config.num_blocks = ray.get(self.actor.start.remote(self.config, self.reserved_pg))
            self.conn = connect(*ray.get(self.actor.open_stream.remote()))
        except BaseException:
            self._release()
            raise
        self._sent = 0  # inputs sent so far
        self._applied = 0  # of those, how many the loop has applied (as of its latest push)
        self._prefix_stats = PrefixCacheStats()  # pushed since the last `make_stats`
        self._offload_stats: KVOffloadStats | None = None  # likewise
        self._stats: SchedulerStats | None = None
        self._recv()  # the loop's first push: its stats before any step

    def restart(self, requests: list[list[EngineCoreRequest]]) -> None:
        """Replace a failed engine (the SchedulerActor and the workers it
        owns, which Ray ends with it) by a new one, and add `requests` to
        it (each list as one `add_requests` call). The new actor and
        workers are placed like the first ones: in the replica's reserved
        group, or in a group made for them anew."""
        with self._send_lock:
            hang_up(self.conn)
            if self.actor is not None:
                try:
                    # Alive (a worker died, not the actor): it removes its
                    # workers' placement group, which it owns.
                    ray.get(self.actor.shutdown.remote(), timeout=RESTART_SHUTDOWN_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - dead or wedged: the kill below ends it
                    pass
                self._release()
            self._start()
        for group in requests:
            self.add_requests(group)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(list(requests)))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = list(request_ids)
        if ids:
            self._send(AbortRequests(ids))
        return ids

    def _send(self, message: EngineCoreInput) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except OSError as e:
                raise EngineDeadError(f"the scheduler actor is gone: {e!r}") from e
            self._sent += 1

    def has_pending_intake(self) -> bool:
        """Inputs were sent that the loop has not reported applied."""
        return self._sent > self._applied

    def step(self) -> list[EngineCoreOutput]:
        """The outputs pushed since the last call, waiting for one push if
        none has arrived. Call it only while requests are unfinished or
        inputs pending: an idle loop pushes nothing."""
        outputs = self._recv()
        while self._ready():
            outputs += self._recv()
        return outputs

    def _ready(self) -> bool:
        try:
            return self.conn.poll()
        except (EOFError, OSError):
            return True  # `_recv` raises the error

    def _recv(self) -> list[EngineCoreOutput]:
        try:
            message = self.conn.recv()
        except (EOFError, OSError) as e:
            raise EngineDeadError(f"the scheduler actor is gone: {e!r}") from e
        if isinstance(message, EngineCoreFailure):
            if message.culprits:
                raise StepFailedError(f"the engine loop failed: {message.error}", message.culprits)
            raise EngineDeadError(f"the engine loop failed: {message.error}")
        assert isinstance(message, EngineCoreOutputs)
        self._applied = message.inputs_applied
        self._stats = message.scheduler_stats
        self._prefix_stats.add(message.scheduler_stats.prefix_cache_stats)
        offload = message.scheduler_stats.kv_offload_stats
        if offload is not None:
            self._offload_stats = self._offload_stats or KVOffloadStats()
            self._offload_stats.add(offload)
        return message.outputs

    def make_stats(self) -> SchedulerStats:
        """The gauges as of the latest push, with the prefix-cache counts of
        every push since the previous call (each counted exactly once)."""
        assert self._stats is not None
        prefix, self._prefix_stats = self._prefix_stats, PrefixCacheStats()
        offload, self._offload_stats = self._offload_stats, None
        return dataclasses.replace(self._stats, prefix_cache_stats=prefix, kv_offload_stats=offload)

    def check_health(self) -> None:
        ray.get(self.actor.check_health.remote())

    def kill(self) -> None:
        actor = self.actor
        if actor is not None:
            ray.kill(actor)  # its connection closes: `step` raises EngineDeadError

    def shutdown(self) -> None:
        if self.actor is None:
            return
        hang_up(self.conn)  # the loop sees the end and stops
        try:
            ray.get(self.actor.shutdown.remote(), timeout=60)
        finally:
            self._release()

    def _release(self) -> None:
        actor_id = self.actor._actor_id.hex()
        ray.kill(self.actor)
        self.actor = None
        remove_groups_made_by(actor_id)
        if self._pg is not None:
            remove_worker_placement_group(self._pg)
            self._pg = None
