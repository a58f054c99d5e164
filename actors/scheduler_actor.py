"""`SchedulerActor`: the Ray shim over the engine core (schedulers, KV block
pools, prefix caches and the worker groups they drive) and the loop that
owns it (engine/core_loop.py, the loop an in-process core runs on a thread).

It asks Ray for no CPU (docs/ARCHITECTURE.md, principle 8): it computes nothing heavy and
must fit beside the workers on a small machine. The exception: at world
size 1 with one DP rank it runs that worker's model itself
(`ParallelConfig.scheduler_hosts_worker`), with the worker's resources and bundle.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import Listener
from typing import TYPE_CHECKING, Any

import ray

from rayvllm.actors.niceness import lower_to_zero
from rayvllm.config import EngineConfig
from rayvllm.distributed.rpc_channel import accept, open_listener
from rayvllm.engine.local_pipe import SocketConnection
from rayvllm.worker.core_share import node_cores

# The engine (torch, the scheduler, the model code) is imported in the
# actor, where it runs: the client that creates this actor imports this
# module too, and a Serve replica never runs a model.
if TYPE_CHECKING:
    from rayvllm.engine.core_loop import EngineCoreLoop
    from rayvllm.engine.engine_core import EngineCore


def _set_threads(config: EngineConfig) -> None:
    """Torch threads for the calling thread (the setting is per thread) of
    an actor that hosts its model: every core on the CPU while the model
    loads (its worker sizes its own share before each step), else one. An
    actor that only schedules never imports torch (Ray's OMP_NUM_THREADS,
    the floor of its CPUs and at least one, covers anything that might)."""
    if not config.parallel_config.scheduler_hosts_worker:
        return
    import torch

    torch.set_num_threads(node_cores() if config.device == "cpu" else 1)


# Utility calls wait for the loop (a weight update may take long) on
# threads of their own, so health checks and shutdown still answer
# meanwhile; more than one, so that a call the loop runs beside its steps
# (a weight-transfer group forming) holds none of the others back.
@ray.remote(num_cpus=0, concurrency_groups={"utility": 4})
class SchedulerActor:
    """Construction is cheap; `start` builds the core so its errors
    (placement, preflight, sizing) reach the caller with their own types.
    From `open_stream` on, the core is touched only by its loop's thread
    (and `check_health`, which only asks the workers)."""

    def __init__(self) -> None:
        lower_to_zero()
        self.config: EngineConfig | None = None
        self.core: EngineCore | None = None
        self._loop_thread: threading.Thread | None = None
        self._listener: Listener | None = None
        self._loop: EngineCoreLoop | None = None
        self._loop_made = threading.Event()

    def start(self, config: EngineConfig, reserved: object = None) -> int:
        """Start every worker group (in `reserved`'s bundles when a Serve
        replica or the caller reserved them); returns the KV blocks per DP rank."""
        from rayvllm.actors.executor_factory import create_executor
        from rayvllm.engine.engine_core import EngineCore

        self.config = config
        _set_threads(config)
        if config.parallel_config.scheduler_hosts_worker:
            from rayvllm.executor.uniproc import UniProcExecutor

            self.core = EngineCore(config, lambda dp_rank: UniProcExecutor(config))
        else:
            self.core = EngineCore(config, lambda dp_rank: create_executor(config, dp_rank, reserved))
        return config.cache_config.num_blocks

    def open_stream(self) -> tuple[tuple[str, int], bytes]:
        """Listen for the client's one connection and return its address
        and key; once it connects, the engine loop runs on its own thread
        until the client hangs up."""
        assert self.core is not None and self._listener is None
        listener, authkey = open_listener(ray.util.get_node_ip_address())
        self._listener = listener
        self._loop_thread = threading.Thread(target=self._serve, name="rayvllm-engine-loop", daemon=True)
        self._loop_thread.start()
        return listener.address, authkey

    def _serve(self) -> None:
        from rayvllm.engine.core_loop import EngineCoreLoop

        assert self.config is not None and self.core is not None and self._listener is not None
        _set_threads(self.config)
        try:
            conn = accept(self._listener)
        except OSError:
            return  # shut down before the client came
        finally:
            self._listener.close()
        self._loop = EngineCoreLoop(self.core, SocketConnection(conn))
        self._loop_made.set()
        self._loop.run()

    @ray.method(concurrency_group="utility")
    def call_utility(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The core's utility `method`, run by its loop between steps
        (core_loop.py); waits for its result."""
        self._loop_made.wait()
        assert self._loop is not None
        return self._loop.intake.call_utility(method, args, kwargs).result()

    def check_health(self) -> None:
        assert self.core is not None
        self.core.check_health()

    def shutdown(self) -> None:
        """Called after the client hung up, so the loop is ending."""
        if self._listener is not None:
            self._listener.close()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=30)
        if self.core is not None:
            self.core.shutdown()
            self.core = None
