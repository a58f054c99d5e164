"""The executor factory, above every executor class (base.py knows none of
them, so no executor module imports another that imports it back)."""

from __future__ import annotations

from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.executor.base import Executor
from rayvllm.executor.uniproc import UniProcExecutor


def create_executor(config: EngineConfig, dp_rank: int = 0, reserved_pg: Any = None) -> Executor:
    """The worker group of one data-parallel rank: Ray actors when any
    parallel size exceeds 1 or the Ray backend is asked for, else in-process.
    Ray is imported only then: the in-process core never loads it.
    `reserved_pg`: the Serve replica's placement group (see RayExecutor)."""
    if config.parallel_config.use_ray:
        from rayvllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, dp_rank, reserved_pg)
    return UniProcExecutor(config)
