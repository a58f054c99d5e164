"""The worker group of a data-parallel rank, in-process or as Ray actors:
decided here, above every executor class (none of them knows the other).

Ray is imported only when the Ray kind is asked for: the in-process engine
never loads it.
"""

from __future__ import annotations

from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.executor.base import Executor


def create_executor(config: EngineConfig, dp_rank: int = 0, reserved: Any = None) -> Executor:
    """The worker group of one data-parallel rank: Ray actors when any
    parallel size exceeds 1 or the Ray backend is asked for, else in-process.
    `reserved`: the `ReservedBundles` the workers go in (see RayExecutor)."""
    if config.parallel_config.use_ray:
        from rayvllm.actors.ray_executor import RayExecutor

        return RayExecutor(config, dp_rank, reserved)
    # Imported here: the worker (torch, the model) is for the process that runs it.
    from rayvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)
