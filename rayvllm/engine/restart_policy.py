"""What the engine does when its core dies (a killed worker, scheduler
actor or node; a step that raised): one policy for the serving and the
offline engine, in-process or on Ray, and, inside the core, for a DP
rank's worker group rebuilt alone (rank_recovery.py).

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
from collections.abc import Callable
from typing import Protocol, TypeVar

from rayvllm.frontend.output_processor import OutputProcessor
from rayvllm.messages.errors import EngineDeadError, PlacementError, StepFailedError
from rayvllm.messages.request import EngineCoreRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


class RestartLimits:
    """The rule for starting something anew after a failure: a start that
    fails is one more failure of the kind that began the restart, tried
    again after a backoff (doubling); past `max_in_a_row` failures with no
    completed step between, the original failure is the end. A start that
    finds no room waits for room without counting. `close` stops every
    restart under way. Thread-safe for one restart at a time."""

    def __init__(self, max_in_a_row: int = MAX_RESTARTS_IN_A_ROW, backoff_s: float = RESTART_BACKOFF_S) -> None:
        self.max_in_a_row = max_in_a_row
        self.backoff_s = backoff_s
        self.in_a_row = 0
        # Starts that failed (each then tried again).
        self.failed_starts = 0
        # Attempts that found no room (each then tries again).
        self.placement_waits = 0
        self._closed = threading.Event()

    def step_done(self) -> None:
        self.in_a_row = 0

    def close(self) -> None:
        """The engine shuts down: a restart under way stops trying."""
        self._closed.set()

    def start_until_running(self, start: Callable[[], T], failure: BaseException, what: str) -> T:
        """`start()`'s result, trying again until a start succeeds; raises
        `failure` when the limit is passed or `close` was called."""
        backoff = self.backoff_s
        while True:
            if self._closed.is_set():
                raise failure
            try:
                return start()
            except PlacementError as e:
                # No room now (a node lost, say): the requests wait, health says so.
                self.placement_waits += 1
                logger.warning("no room for a new %s yet (%s); trying again", what, e)
            except Exception as e:  # noqa: BLE001 - Ray reports a failed start in many types
                self.failed_starts += 1
                self.count(failure, e)
                logger.warning("the new %s failed as it started (%r); trying again in %.1f s", what, e, backoff)
                if self._closed.wait(backoff):
                    raise failure from e
                backoff *= 2

    def count(self, failure: BaseException, cause: BaseException | None = None) -> None:
        """One more failure with no step between: past the limit, the end."""
        if self.in_a_row >= self.max_in_a_row:
            raise failure from cause
        self.in_a_row += 1


class RestartPolicy(RestartLimits):
    """The engine's: a dead core replaced by a new one with the request
    table resumed on it. Invariants: a replacement begins (`begin`, on the
    thread that owns the output processor) before the requests to resume
    are taken, and from then on new inputs wait in the client until the
    new core has the resumed ones; `replace` (on the thread that steps)
    returns only with a new core running them, or raises the failure that
    ended the engine. `restarting_since` is set exactly while a replacement
    is under way."""

    def __init__(
        self, client: ReplaceableCore, output_processor: OutputProcessor,
        max_in_a_row: int = MAX_RESTARTS_IN_A_ROW, backoff_s: float = RESTART_BACKOFF_S,
    ) -> None:
        super().__init__(max_in_a_row, backoff_s)
        self.client = client
        self.output_processor = output_processor
        # Cores replaced so far.
        self.total = 0
        # time.monotonic() when the current replacement began, else None.
        self.restarting_since: float | None = None
        self.last_duration_s: float | None = None
        self._requests: list[list[EngineCoreRequest]] = []

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
            self.count(failure)
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
        requests = self._requests
        try:
            self.start_until_running(
                lambda: self.client.restart(requests, RESTART_SHUTDOWN_TIMEOUT_S), failure, "engine core"
            )
        finally:
            self.last_duration_s = time.monotonic() - self.restarting_since
            self.restarting_since = None
            self._requests = []
        self.total += 1
        logger.warning("new engine core ready after %.1f s", self.last_duration_s)
