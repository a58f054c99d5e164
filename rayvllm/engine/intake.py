"""Adds and aborts on their way into an engine core, from any thread.

The engine loop (core_loop.py, on the SchedulerActor or on a thread of
the client's process) has its connection's reader thread put every input
here the moment it arrives, and the core takes them right before it
schedules (`EngineCore.step`), so a request that arrives during a forward
makes the very next step.

Invariants: inputs are applied in the order they were put, so an abort
never overtakes the add it names; `applied` counts every input applied so
far (the loop reports it to its client with each push).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

from rayvllm.messages.engine_types import AbortRequests, AddRequests, EngineCoreInput
from rayvllm.messages.request import EngineCoreRequest


class IntakeTarget(Protocol):
    """What takes the drained inputs: an engine core."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> object: ...


class RequestIntake:
    def __init__(self) -> None:
        self._items: deque[EngineCoreInput] = deque()
        self._arrived = threading.Condition()
        self._closed = False
        self._woken = False
        self.applied = 0

    # ---- any thread ----------------------------------------------------------------

    def put(self, item: EngineCoreInput) -> None:
        with self._arrived:
            self._items.append(item)
            self._arrived.notify_all()

    def put_all(self, items: list[EngineCoreInput]) -> None:
        """Several inputs at once: a step takes all of them or none."""
        with self._arrived:
            self._items.extend(items)
            self._arrived.notify_all()

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.put(AddRequests(list(requests)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.put(AbortRequests(list(request_ids)))

    def wake(self) -> None:
        """Wake the stepping thread with no input (the engine core has work
        again: a rebuilt DP rank)."""
        with self._arrived:
            self._woken = True
            self._arrived.notify_all()

    def close(self) -> None:
        """No more inputs will come (the client hung up)."""
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def has_pending_intake(self) -> bool:
        return bool(self._items)

    # ---- the thread that steps -----------------------------------------------------

    def wait_for_input(self) -> bool:
        """Block until an input is pending or `wake` was called (True), or
        the intake is closed (False)."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._items or self._woken or self._closed)
            self._woken = False
            return not self._closed

    def drain_into(self, core: IntakeTarget) -> None:
        """Hand everything that has arrived to `core`, in arrival order."""
        while self._items:
            item = self._items.popleft()
            if isinstance(item, AddRequests):
                core.add_requests(item.requests)
            else:
                core.abort_requests(item.request_ids)
            self.applied += 1
