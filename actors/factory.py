"""Where in-process or Ray is decided for the engine, above every engine
class (none of them knows the other kind): the engine core client and the
engines built from `EngineArgs` (a DP rank's worker group: executor_factory.py).

Ray is imported only when the Ray kind is asked for (any parallel size
above 1, or `distributed_executor_backend="ray"`): the in-process engine
never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.engine.llm_engine import LLMEngine
from rayvllm.messages.errors import InvalidParameterError


def make_engine_core(
    config: EngineConfig, reserved_pg: Any = None, threaded: bool = True, *,
    placement_group: Any = None, placement_group_bundle_indices: Sequence[int] | None = None,
) -> EngineCoreClient:
    """The core in this process by default (its loop on a thread of its own,
    or with `threaded=False` on the caller's thread: `InprocClient`); in a
    SchedulerActor on Ray when any parallel size exceeds 1 or
    `distributed_executor_backend="ray"`. Where its workers go, on Ray:
    `reserved_pg`, a Serve replica's group (`deployment_bundles`); or
    `placement_group`, a caller's, the ranks in the bundles
    `placement_group_bundle_indices` names (default: the first, in order),
    e.g. beside an RL trainer's own; else groups the engine makes."""
    pc = config.parallel_config
    if pc.use_ray:
        from rayvllm.actors.placement import caller_bundles, replica_bundles
        from rayvllm.actors.ray_core_client import RayEngineCoreClient

        if placement_group is not None:
            reserved = caller_bundles(placement_group, pc, config.device, placement_group_bundle_indices)
        elif placement_group_bundle_indices is not None:
            raise InvalidParameterError("placement_group_bundle_indices", "needs placement_group")
        else:
            reserved = replica_bundles(reserved_pg, pc) if reserved_pg is not None else None
        return RayEngineCoreClient(config, reserved)
    if placement_group is not None or placement_group_bundle_indices is not None:
        raise InvalidParameterError(
            "placement_group", "needs the Ray backend (distributed_executor_backend='ray' or a parallel size above 1)"
        )
    from rayvllm.actors.executor_factory import create_executor
    from rayvllm.engine.inproc_client import InprocClient

    return InprocClient(config, lambda dp_rank: create_executor(config, dp_rank), threaded)


def async_llm_from_engine_args(
    args: EngineArgs | EngineConfig, *, reserved_pg: Any = None, placement_group: Any = None,
    placement_group_bundle_indices: Sequence[int] | None = None, **options: Any,
) -> AsyncLLM:
    """vLLM's `AsyncLLM.from_engine_args`: the serving engine over the core
    `make_engine_core` picks (which says where `reserved_pg`,
    `placement_group` and `placement_group_bundle_indices` put it);
    `options`: `AsyncLLM`'s own (admission bounds, `step_timeout_s`)."""
    config = args.create_engine_config() if isinstance(args, EngineArgs) else args
    core = make_engine_core(
        config, reserved_pg, placement_group=placement_group,
        placement_group_bundle_indices=placement_group_bundle_indices,
    )
    return AsyncLLM(config, core, **options)


def llm_engine_from_engine_args(
    args: EngineArgs | EngineConfig, *, placement_group: Any = None,
    placement_group_bundle_indices: Sequence[int] | None = None,
) -> LLMEngine:
    """vLLM's `LLMEngine.from_engine_args`: the synchronous engine over the
    core `make_engine_core` picks; in this process, its loop turns on the
    caller's thread."""
    config = args.create_engine_config() if isinstance(args, EngineArgs) else args
    core = make_engine_core(
        config, threaded=False, placement_group=placement_group,
        placement_group_bundle_indices=placement_group_bundle_indices,
    )
    return LLMEngine(config, core)
