"""The engine loop's one seam to the engine core: `make_client` returns the
in-process core or the Ray client of the SchedulerActor behind the same
interface, so `AsyncLLM` holds a client and never asks which one.

Both take adds and aborts from any thread (the serving loop's), in order,
and hand them to the core before it schedules: the Ray client sends each at
once on its intake channel; the in-process client keeps them in a
`RequestIntake` that its `step` drains first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from rayvllm.config import EngineConfig
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine.intake import RequestIntake
from rayvllm.frontend.output_processor import OutputProcessor
from rayvllm.messages.engine_types import EngineCoreOutput, SchedulerStats
from rayvllm.messages.errors import EngineDeadError, PlacementError, StepFailedError
from rayvllm.messages.request import EngineCoreRequest

if TYPE_CHECKING:
    from rayvllm.engine.ray_core_client import RayEngineCoreClient

logger = logging.getLogger(__name__)

# A failure that recurs this many times with no step completed in between (a
# request that kills every new core, say) is final.
MAX_RESTARTS_IN_A_ROW = 3


class EngineCoreClient(Protocol):
    """What the engine loop calls. `add_requests`, `abort_requests` and
    `has_pending_intake` may be called from any thread, also during `step`;
    the rest only from the one thread that steps."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: Iterable[str]) -> object: ...

    def has_pending_intake(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def make_stats(self) -> SchedulerStats: ...

    def check_health(self) -> None: ...

    def restart(self, requests: list[list[EngineCoreRequest]]) -> None:
        """After `step` raised `EngineDeadError`: a new core in place of the
        dead one, with `requests` added (each list in one call); raises
        `EngineDeadError` when the core cannot be replaced."""
        ...

    def kill(self) -> None:
        """End a hung core at once, from any thread: a `step` waiting on it
        raises `EngineDeadError`. (An in-process core cannot be ended
        under its own step; there this does nothing.)"""
        ...

    def shutdown(self) -> None: ...


class InprocClient:
    """The in-process `EngineCore` behind the client interface."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.intake = RequestIntake()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.intake.add_requests(list(requests))

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = list(request_ids)
        if ids:
            self.intake.abort_requests(ids)
        return ids

    def has_pending_intake(self) -> bool:
        return self.intake.has_pending_intake()

    def step(self) -> list[EngineCoreOutput]:
        self.intake.drain_into(self.core)
        return self.core.step()

    def make_stats(self) -> SchedulerStats:
        return self.core.make_stats()

    def check_health(self) -> None:
        self.core.check_health()

    def kill(self) -> None:
        pass  # the step runs on this process's thread; nothing can end it

    def restart(self, requests: list[list[EngineCoreRequest]]) -> None:
        # The core shares this process: what killed it is no worker's fault
        # that a new one would escape.
        raise EngineDeadError("the in-process engine core failed and cannot be replaced")

    def shutdown(self) -> None:
        self.core.shutdown()


def make_engine_core(config: EngineConfig, reserved_pg: Any = None) -> "EngineCore | RayEngineCoreClient":
    """In-process core by default; the SchedulerActor on Ray when any
    parallel size exceeds 1 or `distributed_executor_backend="ray"`
    (`reserved_pg`: the Serve replica's placement group, for that case)."""
    if config.parallel_config.use_ray:
        from rayvllm.engine.ray_core_client import RayEngineCoreClient

        return RayEngineCoreClient(config, reserved_pg)
    return EngineCore(config)


def make_client(config: EngineConfig, reserved_pg: Any = None) -> EngineCoreClient:
    """The in-process core, or on Ray (any parallel size above 1, or
    `distributed_executor_backend="ray"`) the SchedulerActor's client
    (`reserved_pg`: the Serve replica's placement group, for that case)."""
    core = make_engine_core(config, reserved_pg)
    return InprocClient(core) if isinstance(core, EngineCore) else core


class CoreRestarts:
    """What the engine loop does when `step` raises `EngineDeadError`: a
    new core in place of the failed one (a dead worker, scheduler actor or
    node), with every unfinished request of the output processor (the
    source of truth) resumed on it, so no request is lost and no token
    repeated. A step that failed on a live worker names its culprits
    (`StepFailedError`): they fail alone, the rest resume.

    `drop_culprits` and `resumable` run on the thread that owns the output
    processor, `replace_core` on the one that steps."""

    def __init__(self, client: EngineCoreClient, output_processor: OutputProcessor) -> None:
        self.client = client
        self.output_processor = output_processor
        self.in_a_row = 0
        self.total = 0
        # time.monotonic() when the current replacement began, else None.
        self.restarting_since: float | None = None
        # Set by the engine's shutdown: stop waiting for room.
        self.closed = False
        self.last_duration_s: float | None = None
        # Attempts that found no room for the new core (each then tries again).
        self.placement_waits = 0

    def step_done(self) -> None:
        self.in_a_row = 0

    def drop_culprits(self, failure: EngineDeadError) -> list[str]:
        """Forget the requests `failure` blames and return their user
        request ids. A failure that blames none counts toward the limit:
        past MAX_RESTARTS_IN_A_ROW with no step between, `failure` is
        re-raised (each blaming failure removes requests, so those end)."""
        culprits = failure.culprits if isinstance(failure, StepFailedError) else []
        failed = self.output_processor.drop_requests(culprits)
        if not failed:
            if self.in_a_row >= MAX_RESTARTS_IN_A_ROW:
                raise failure
            self.in_a_row += 1
        return failed

    def replace_core(self, failure: EngineDeadError, requests: list[list[EngineCoreRequest]]) -> None:
        """Start a new core with `requests` (`OutputProcessor.resumable_requests`);
        re-raises `failure` when the core cannot be replaced (in-process)."""
        logger.warning(
            "engine core failed (%s); starting a new one and resuming %d requests",
            failure, sum(len(group) for group in requests),
        )
        self.restarting_since = time.monotonic()
        try:
            while True:
                try:
                    self.client.restart(requests)
                    break
                except PlacementError as e:
                    # No room for the engine now (a node lost, say): the
                    # requests wait, health says so, and each attempt waits
                    # placement_group_timeout_s for capacity to come back.
                    if self.closed:
                        raise failure from e
                    self.placement_waits += 1
                    logger.warning("no room for a new engine core yet (%s); trying again", e)
                except Exception as e:  # noqa: BLE001 - Ray reports a failed start in many types
                    raise failure from e
        finally:
            self.last_duration_s = time.monotonic() - self.restarting_since
            self.restarting_since = None
        self.total += 1
        logger.warning("new engine core ready after %.1f s", self.last_duration_s)
