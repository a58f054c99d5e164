"""What the engine does when its core dies (a killed worker, scheduler
actor or node; a step that raised): one policy for the serving and the
offline engine, in-process or on Ray.

It decides whether the core is replaced (the client can replace it; not
past `max_in_a_row` failures with no step completed between), fails the
requests a failure blames alone, takes every other unfinished request
from the output processor's table (the source of truth: prompt plus the
tokens already emitted) and resumes them on a new core, so no request is
lost and no token repeated. A start that fails (the new core dies too,
say) is one more failure of the same kind: counted, then tried again
after a backoff. A start that finds no room waits for room without
counting (each attempt waits `placement_group_timeout_s`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from rayvllm.errors import EngineDeadError, PlacementError, StepFailedError
from rayvllm.output_processor import OutputProcessor
from rayvllm.request import EngineCoreRequest

logger = logging.getLogger(__name__)

# A failure that recurs this many times with no step completed in between (a
# request that kills every new core, say) is final.
MAX_RESTARTS_IN_A_ROW = 3
# The wait before the first retry of a failed start, doubled for each next one.
RESTART_BACKOFF_S = 0.5
# How long a failed engine's core gets to shut down cleanly before it is ended.
RESTART_SHUTDOWN_TIMEOUT_S = 10.0


class ReplaceableCore(Protocol):
    """What the policy needs of the client (core_client.EngineCoreClient)."""

    can_restart: bool

    def hold(self) -> None: ...

    def restart(self, requests: list[list[EngineCoreRequest]], shutdown_timeout_s: float) -> None: ...


class RestartPolicy:
    """Invariants: a replacement begins (`begin`, on the thread that owns
    the output processor) before the requests to resume are taken, and from
    then on new inputs wait in the client until the new core has the
    resumed ones; `replace` (on the thread that steps) returns only with a
    new core running them, or raises the failure that ended the engine.
    `restarting_since` is set exactly while a replacement is under way."""

    def __init__(
        self, client: ReplaceableCore, output_processor: OutputProcessor,
        max_in_a_row: int = MAX_RESTARTS_IN_A_ROW, backoff_s: float = RESTART_BACKOFF_S,
    ) -> None:
        self.client = client
        self.output_processor = output_processor
        self.max_in_a_row = max_in_a_row
        self.backoff_s = backoff_s
        self.in_a_row = 0
        # Cores replaced so far.
        self.total = 0
        # Starts of a new core that failed (each then tried again).
        self.failed_starts = 0
        # Attempts that found no room for the new core (each then tries again).
        self.placement_waits = 0
        # time.monotonic() when the current replacement began, else None.
        self.restarting_since: float | None = None
        self.last_duration_s: float | None = None
        self._requests: list[list[EngineCoreRequest]] = []
        self._closed = threading.Event()

    def step_done(self) -> None:
        self.in_a_row = 0

    def close(self) -> None:
        """The engine shuts down: a replacement under way stops trying."""
        self._closed.set()

    def begin(self, failure: EngineDeadError) -> list[str]:
        """Start replacing the core that `failure` ended: forget the
        requests it blames and return their user request ids; hold new
        inputs and take the requests to resume. Raises `failure` when the
        core is not to be replaced."""
        if not self.client.can_restart:
            raise failure
        culprits = failure.culprits if isinstance(failure, StepFailedError) else []
        failed = self.output_processor.drop_requests(culprits)
        if not failed:
            # Each blaming failure removes requests, so those end by themselves.
            self._count(failure)
        self.client.hold()
        self._requests = self.output_processor.resumable_requests()
        self.restarting_since = time.monotonic()
        return failed

    def replace(self, failure: EngineDeadError) -> None:
        """Start a new core with the requests `begin` took, trying again
        until one runs; raises `failure` when the engine ends instead."""
        logger.warning(
            "engine core failed (%s); starting a new one and resuming %d requests",
            failure, sum(len(group) for group in self._requests),
        )
        assert self.restarting_since is not None
        try:
            self._start_until_running(failure)
        finally:
            self.last_duration_s = time.monotonic() - self.restarting_since
            self.restarting_since = None
            self._requests = []
        self.total += 1
        logger.warning("new engine core ready after %.1f s", self.last_duration_s)

    def _start_until_running(self, failure: EngineDeadError) -> None:
        backoff = self.backoff_s
        while True:
            if self._closed.is_set():
                raise failure
            try:
                self.client.restart(self._requests, RESTART_SHUTDOWN_TIMEOUT_S)
                return
            except PlacementError as e:
                # No room for the engine now (a node lost, say): the
                # requests wait, health says so.
                self.placement_waits += 1
                logger.warning("no room for a new engine core yet (%s); trying again", e)
            except Exception as e:  # noqa: BLE001 - Ray reports a failed start in many types
                self.failed_starts += 1
                self._count(failure, e)
                logger.warning("the new engine core failed as it started (%r); trying again in %.1f s", e, backoff)
                if self._closed.wait(backoff):
                    raise failure from e
                backoff *= 2

    def _count(self, failure: EngineDeadError, cause: BaseException | None = None) -> None:
        """One more failure with no step between: past the limit, the end."""
        if self.in_a_row >= self.max_in_a_row:
            raise failure from cause
        self.in_a_row += 1
