"""`WorkerActor`: the Ray shim over one rank's `Worker`."""

from __future__ import annotations

from typing import Any

import ray

from rayvllm.actors.niceness import lower_to_zero
from rayvllm.config import EngineConfig
from rayvllm.distributed.rpc_channel import ChannelServer
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.utils.network import free_port


# `node` answers health checks on a thread of its own: a `call` may hold
# the actor's thread for long (a weight-transfer group forming, up to its
# timeout), and a rank that is only waiting is not dead.
@ray.remote(concurrency_groups={"health": 1})
class WorkerActor:
    """Methods run one at a time, in the order the executor called them
    (the default actor concurrency of 1), `node` aside (its own group):
    every rank sees steps in order."""

    def __init__(self, config: EngineConfig, rank: int, dp_rank: int = 0) -> None:
        lower_to_zero()
        # First: `__repr__` names the actor in the error if the worker fails to build.
        self.rank = rank
        self.dp_rank = dp_rank if config.parallel_config.data_parallel_size > 1 else None
        self.channel: ChannelServer[SchedulerOutput, ModelRunnerOutput] | None = None
        # Here, in the rank's process: the executor that creates this actor
        # imports this module and runs no model (torch and the model code).
        from rayvllm.worker.worker import create_worker

        self.worker = create_worker(config, rank)
        self.worker.set_threads()

    def __repr__(self) -> str:
        # Ray shows this as the actor's name in `ray list actors`, the
        # dashboard and its log lines: which rank a process is.
        dp = "" if self.dp_rank is None else f", dp_rank={self.dp_rank}"
        return f"WorkerActor(rank={self.rank}{dp})"

    @ray.method(concurrency_group="health")
    def node(self) -> tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def call(self, method: str, *args: Any) -> Any:
        """Setup and teardown calls (`init_distributed`, `preflight`, `load_model`, ...)
        and `collective_rpc`'s (`run_method`). They run on the actor's thread,
        steps on the channel's: the engine loop sends none while one runs.
        The actor's thread is not the one `__init__` ran on (the health
        group makes the actor threaded), and a torch thread count is per
        thread: set it here too."""
        self.worker.set_threads()
        return getattr(self.worker, method)(*args)

    def open_channel(self) -> tuple[tuple[str, int], bytes]:
        """Serve the worker's steps (`execute_model`) on a direct channel;
        returns its address and key. Steps then arrive there, not as actor
        calls."""
        self.channel = ChannelServer(
            self.worker.execute_model, ray.util.get_node_ip_address(), on_thread_start=self.worker.set_threads
        )
        return self.channel.address, self.channel.authkey

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.worker.shutdown()
