"""The worker group of one data-parallel rank, as Ray actors.

Startup: placement group (one bundle per rank) -> one `WorkerActor` per rank
-> torch.distributed world and TP groups -> preflight -> weights -> KV cache.
Every phase waits at most `distributed_timeout_s` and, when ranks fail to
answer, raises an error that names them and their nodes.

A step is one message per rank on a direct channel (see rpc_channel.py for
why not a Ray call), sent together; the driver rank's reply is the step's
output. Steps skip Ray entirely; setup and teardown go through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import ray
from ray.exceptions import RayActorError

from rayvllm.actors.placement import (
    RankPlacement,
    create_worker_placement_group,
    ReservedBundles,
    reserved_worker_placements,
    rank_actor_options,
    remove_worker_placement_group,
    worker_group_name,
)
from rayvllm.actors.remote_errors import get_unwrapped
from rayvllm.actors.worker_actor import WorkerActor
from rayvllm.config import EngineConfig
from rayvllm.distributed.rpc_channel import ChannelClient, pickle_message
from rayvllm.executor.base import Executor, PendingOutput
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.errors import DistributedInitError, EngineDeadError
from rayvllm.messages.scheduler_output import SchedulerOutput


class _PendingStep:
    def __init__(self, executor: "RayExecutor") -> None:
        self.executor = executor

    def result(self) -> ModelRunnerOutput:
        # Every rank replies (non-drivers with an empty output), in step
        # order; reading them all keeps the channels aligned and surfaces a
        # failure on any rank. Channels are read as they become ready, not
        # in rank order: when one rank dies, the others wait in a collective
        # that would only time out, but the dead rank's channel reports EOF
        # at once.
        ex = self.executor
        pending = dict(enumerate(ex.channels))
        outputs: dict[int, ModelRunnerOutput] = {}
        while pending:
            connections = [channel.connection for channel in pending.values()]
            # One left: its reply is next in any case (no poll syscall).
            ready = connections if len(connections) == 1 else wait(connections)
            for rank, channel in list(pending.items()):
                if channel.connection not in ready:
                    continue
                try:
                    outputs[rank] = channel.recv()
                except (EOFError, OSError) as e:
                    raise EngineDeadError(
                        f"worker rank {rank} of DP rank {ex.dp_rank} ({ex._where(rank)}) is gone: {e!r}"
                    ) from e
                del pending[rank]
        output = outputs[ex.driver_rank]
        if len(outputs) > 1:
            # A block is loaded only where every rank's shard of it loaded.
            output.kv_load_failures = sorted({b for out in outputs.values() for b in out.kv_load_failures})
        return output

    def done(self) -> bool:
        # Replies come in step order, so a ready channel holds this step's.
        return all(channel.poll() for channel in self.executor.channels)

    def wait_handles(self) -> list[Any]:
        return [channel.connection for channel in self.executor.channels]


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, dp_rank: int = 0, reserved: ReservedBundles | None = None) -> None:
        """`reserved`: bundles of a group the engine did not make (a Serve
        replica's or a caller's: used, never removed here); without them
        the executor creates and removes its own group."""
        super().__init__(config)
        self.dp_rank = dp_rank
        self.reserved = reserved
        pc = config.parallel_config
        self.world_size = pc.world_size
        # TP rank 0 of the last stage samples (see ParallelContext.is_driver).
        self.driver_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.pg: Any = None
        self.placements: list[RankPlacement] = []
        self.workers: list[Any] = []
        self.channels: list[ChannelClient[SchedulerOutput, ModelRunnerOutput]] = []

    def initialize(self) -> int:
        self.start_workers()
        self.init_distributed()
        num_blocks = self.load_model()
        endpoints = self._on_all("channel setup", [w.open_channel.remote() for w in self.workers], 60)
        self.channels = [ChannelClient(address, key) for address, key in endpoints]
        return num_blocks

    # ---- startup phases (separate so tests can intervene between them) -------------

    def start_workers(self) -> None:
        pc = self.config.parallel_config
        if self.reserved is not None:
            group = self.reserved.pg
            self.placements = reserved_worker_placements(self.reserved, pc, self.dp_rank)
        else:
            name = worker_group_name(self.dp_rank)
            self.pg, self.placements = create_worker_placement_group(pc, self.config.device, name)
            group = self.pg
        self.workers = [
            WorkerActor.options(**rank_actor_options(pc, self.config.device, group, p)).remote(
                self.config, p.rank, self.dp_rank
            )
            for p in self.placements
        ]

    def init_distributed(self) -> None:
        """Form the process group and run the preflight; on failure, name
        the ranks that did not answer (dead or silent) and their nodes."""
        pc = self.config.parallel_config
        timeout = pc.distributed_timeout_s
        # Starting the actor processes (imports included) is bounded like placement.
        self._on_all("actor start", [w.node.remote() for w in self.workers], pc.placement_group_timeout_s)
        if self.world_size == 1:
            return
        port = self._on_all("actor start", [self.workers[0].free_port.remote()], timeout)[0]
        addr = self.placements[0].node_ip
        refs = [w.call.remote("init_distributed", addr, port, timeout) for w in self.workers]
        self._on_all("process group init", refs, timeout + 15)
        self._on_all("preflight", [w.call.remote("preflight") for w in self.workers], timeout + 15)

    def load_model(self) -> int:
        timeout = None  # loading large weights legitimately takes long
        self._on_all("load_model", [w.call.remote("load_model") for w in self.workers], timeout)
        blocks = self._on_all(
            "KV sizing", [w.call.remote("determine_num_blocks") for w in self.workers], timeout
        )
        num_blocks = min(blocks)
        self._on_all(
            "KV allocation", [w.call.remote("initialize_kv_cache", num_blocks) for w in self.workers], timeout
        )
        return num_blocks

    def _on_all(self, phase: str, refs: list[ray.ObjectRef], timeout: float | None) -> list[Any]:
        """Results of one call per rank (rank order); raises
        `DistributedInitError` naming every rank that failed or stayed
        silent. A rank whose actor dies ends the wait at once: the others
        may be blocked on it (a rendezvous or collective that never
        completes without it), so they are named as waiting, not blamed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        outcomes: dict[ray.ObjectRef, tuple[str, Any]] = {}
        pending = list(refs)
        died = False
        while pending and not died:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                break
            for ref in ready:
                try:
                    outcomes[ref] = ("ok", ray.get(ref))
                except RayActorError as e:
                    outcomes[ref] = ("died", e)
                    died = True
                except Exception as e:  # noqa: BLE001 - each rank's cause goes into the message
                    outcomes[ref] = ("raised", e)
        results: list[Any] = []
        silent: list[str] = []
        failed: list[str] = []
        waiting: list[str] = []
        for rank, ref in enumerate(refs):
            where = self._where(rank)
            kind, value = outcomes.get(ref, ("unfinished", None))
            if kind == "ok":
                results.append(value)
            elif kind == "died":
                silent.append(f"rank {rank} ({where}; its actor died: {str(value).splitlines()[0]})")
            elif kind == "raised":
                failed.append(f"rank {rank} ({where}): {type(value).__name__}: {str(value).splitlines()[-1]}")
            elif died:
                waiting.append(f"rank {rank} ({where})")
            else:
                silent.append(f"rank {rank} ({where})")
        if silent or failed:
            parts = [f"worker group of DP rank {self.dp_rank} failed at {phase}"]
            if silent:
                parts.append("did not answer: " + "; ".join(silent))
            if failed:
                parts.append("raised: " + "; ".join(failed))
            if waiting:
                parts.append("still waiting, likely on the dead rank (not blamed): " + "; ".join(waiting))
            raise DistributedInitError(". ".join(parts))
        return results

    def _where(self, rank: int) -> str:
        p = self.placements[rank] if rank < len(self.placements) else None
        return f"node {p.node_ip} id {p.node_id[:12]}" if p else "unplaced"

    # ---- steps -------------------------------------------------------------------

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        if self.world_size == 1:
            self.channels[0].send(scheduler_output)
        else:
            message = pickle_message(scheduler_output)  # serialised once for all ranks
            for channel in self.channels:
                channel.send_pickled(message)
        return _PendingStep(self)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        # Actor calls, not the step channels: object refs in the arguments
        # travel in band (Ray tracks them), and a rank's error keeps its type.
        return get_unwrapped([w.call.remote("run_method", method, args, kwargs or {}) for w in self.workers])

    def check_health(self) -> None:
        self._on_all("health check", [w.node.remote() for w in self.workers], 30)

    def shutdown(self) -> None:
        """Close the channels, destroy the process groups, then the actors
        and the placement group if this executor made it."""
        for channel in self.channels:
            channel.close()
        self.channels = []
        if self.workers:
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            except Exception:  # noqa: BLE001
                # Best effort: a dead, stuck or failing rank loses its
                # process group anyway when the kill below ends its process.
                pass
            for w in self.workers:
                ray.kill(w)
            self.workers = []
        if self.pg is not None:
            remove_worker_placement_group(self.pg)
            self.pg = None
