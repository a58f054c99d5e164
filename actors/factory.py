"""Where in-process or Ray is decided for the engine, above every engine
class (none of them knows the other kind): the engine core client and the
engines built from `EngineArgs` (a DP rank's worker group: executor_factory.py).

Ray is imported only when the Ray kind is asked for (any parallel size
above 1, or `distributed_executor_backend="ray"`): the in-process engine
never loads it.
"""

from __future__ import annotations

from typing import Any

from rayvllm.actors.executor_factory import create_executor
from rayvllm.config import EngineConfig
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.engine.core_client import EngineCoreClient, InprocClient
from rayvllm.engine.llm_engine import LLMEngine


def make_engine_core(config: EngineConfig, reserved_pg: Any = None, threaded: bool = True) -> EngineCoreClient:
    """The core in this process by default (its loop on a thread of its own,
    or with `threaded=False` on the caller's thread: `InprocClient`); in a
    SchedulerActor on Ray when any parallel size exceeds 1 or
    `distributed_executor_backend="ray"` (`reserved_pg`: the Serve
    replica's placement group, for that case)."""
    if config.parallel_config.use_ray:
        from rayvllm.actors.ray_core_client import RayEngineCoreClient

        return RayEngineCoreClient(config, reserved_pg)
    return InprocClient(config, lambda dp_rank: create_executor(config, dp_rank), threaded)


def async_llm_from_engine_args(
    args: EngineArgs | EngineConfig, *, reserved_pg: Any = None, **options: Any
) -> AsyncLLM:
    """vLLM's `AsyncLLM.from_engine_args`: the serving engine over the core
    `make_engine_core` picks; `options`: `AsyncLLM`'s own (admission
    bounds, `step_timeout_s`)."""
    config = args.create_engine_config() if isinstance(args, EngineArgs) else args
    return AsyncLLM(config, make_engine_core(config, reserved_pg), **options)


def llm_engine_from_engine_args(args: EngineArgs | EngineConfig) -> LLMEngine:
    """vLLM's `LLMEngine.from_engine_args`: the synchronous engine over the
    core `make_engine_core` picks; in this process, its loop turns on the
    caller's thread."""
    config = args.create_engine_config() if isinstance(args, EngineArgs) else args
    return LLMEngine(config, make_engine_core(config, threaded=False))
