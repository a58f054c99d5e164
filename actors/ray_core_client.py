"""The engine core in a `SchedulerActor` (its loop: core_loop.py), behind
the one client interface (core_client.py), so `AsyncLLM` cannot tell it
from the in-process core (docs/ARCHITECTURE.md, principle 1).

One direct connection (rpc_channel.py says why not Ray calls) carries both
ways; the actor serves it with the same loop the in-process client runs on
a thread.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import ray

from rayvllm.actors.placement import (
    ReservedBundles,
    remove_groups_made_by,
    remove_worker_placement_group,
    scheduler_actor_options,
)
from rayvllm.actors.remote_errors import get_unwrapped
from rayvllm.actors.scheduler_actor import SchedulerActor
from rayvllm.config import EngineConfig, ParallelConfig
from rayvllm.distributed.rpc_channel import connect
from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.engine.local_pipe import CoreConnection, SocketConnection
from rayvllm.messages.errors import EngineDeadError, PlacementError


def ensure_ray_initialized(pc: ParallelConfig) -> None:
    """Join the Ray cluster this process can find (RAY_ADDRESS or a local
    `ray start`); otherwise start a local one with at least enough logical
    CPUs for every worker rank, oversubscribing a small machine on purpose
    (the ranks' torch threads are sized to the real cores), and without the
    dashboard: its processes wake hundreds of times a second, each time
    taking a core from the forward on a small machine (docs/BENCHMARKS.md);
    whoever wants it starts the cluster with `ray start`."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", log_to_driver=False)
        return
    except ConnectionError:
        pass
    needed = pc.data_parallel_size * pc.world_size * pc.num_cpus_per_worker
    ray.init(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), log_to_driver=False, include_dashboard=False)


class RayEngineCoreClient(EngineCoreClient):
    """The core in a SchedulerActor, with the worker groups it owns."""

    def __init__(self, config: EngineConfig, reserved: ReservedBundles | None = None) -> None:
        """`reserved`: bundles of a placement group the engine did not make
        (a Serve replica's, which Serve removes with the replica, or a
        caller's): the actor and the workers go in them, and the group is
        left as it was at shutdown. Without them the engine makes its own
        groups. At world size 1 with one DP rank the actor runs the model
        itself (`ParallelConfig.scheduler_hosts_worker`). A new core after a failure is
        placed like the first."""
        super().__init__(config)
        self.reserved = reserved
        self.actor: Any = None
        self._pg: Any = None
        # A group a start found no room for: the next start waits on it
        # again (placement.py says why); removed at shutdown.
        self._waiting_pg: Any = None
        self._waiting_lock = threading.Lock()
        self._shut = False
        try:
            self._start()
        except BaseException:
            self._drop_waiting_group()
            raise

    def _launch(self) -> CoreConnection:
        """Start a SchedulerActor (and through it the workers) and connect
        to its loop."""
        pc = self.config.parallel_config
        ensure_ray_initialized(pc)
        with self._waiting_lock:
            pending, self._waiting_pg = self._waiting_pg, None
        try:
            options, self._pg = scheduler_actor_options(pc, self.config.device, self.reserved, pending)
        except PlacementError as e:
            self._keep_waiting(e.pending_group)
            raise
        self.actor = SchedulerActor.options(**options).remote()
        self.config.cache_config.num_blocks = ray.get(self.actor.start.remote(self.config, self.reserved))
        return SocketConnection(connect(*ray.get(self.actor.open_stream.remote())))

    def _release(self, timeout_s: float) -> None:
        actor = self.actor
        if actor is None:
            return
        if timeout_s > 0:
            try:
                # Alive (a worker died, not the actor): it removes its
                # workers' placement group, which it owns.
                ray.get(actor.shutdown.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - dead or wedged: the kill below ends it
                pass
        actor_id = actor._actor_id.hex()
        ray.kill(actor)
        self.actor = None
        remove_groups_made_by(actor_id)
        if self._pg is not None:
            remove_worker_placement_group(self._pg)
            self._pg = None

    def shutdown(self) -> None:
        super().shutdown()
        self._drop_waiting_group()

    def _keep_waiting(self, pg: Any) -> None:
        """`pg` for the next start to wait on; removed at once if the
        client shut down meanwhile."""
        with self._waiting_lock:
            if not self._shut:
                self._waiting_pg = pg
                return
        if pg is not None:
            remove_worker_placement_group(pg)

    def _drop_waiting_group(self) -> None:
        with self._waiting_lock:
            self._shut = True
            pg, self._waiting_pg = self._waiting_pg, None
        if pg is not None:
            remove_worker_placement_group(pg)

    def check_health(self) -> None:
        actor = self.actor
        if actor is None:
            raise EngineDeadError("the scheduler actor is being replaced")
        ray.get(actor.check_health.remote())

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # A Ray call, not the connection: object refs in the arguments
        # travel in band, as Ray tracks them (pickled on a socket, a ref
        # would pin its object for the life of its owner).
        actor = self.actor
        if actor is None:
            raise EngineDeadError("the scheduler actor is being replaced")
        return get_unwrapped(actor.call_utility.remote(method, args, kwargs))

    def share_weights(self, weights: Any) -> Any:
        from rayvllm.distributed.weight_transfer import HostWeights  # torch: only for a caller that syncs

        if isinstance(weights, Mapping):
            weights = HostWeights.of(weights)
        return ray.put(weights) if isinstance(weights, HostWeights) else weights

    def transfer_address(self) -> str:
        return ray.util.get_node_ip_address()

    def kill(self) -> None:
        actor = self.actor
        if actor is not None:
            ray.kill(actor)  # its connection closes: `step` raises EngineDeadError
