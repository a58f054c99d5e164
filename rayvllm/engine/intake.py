"""Adds, aborts and utility calls on their way into an engine core, from any thread.

The engine loop (core_loop.py, on the SchedulerActor or on a thread of
the client's process) has its connection's reader thread put every input
here the moment it arrives, and the core takes them right before it
schedules (`EngineCore.step`), so a request that arrives during a forward
makes the very next step.

A utility call (`call_utility`: a control-plane method of the core, such
as `collective_rpc` or a weight update) waits in the same queue; the core
takes no input past it, and the loop runs it once no step is in flight
(core_loop.py), then sets its future.

Invariants: inputs are applied in the order they were put, so an abort
never overtakes the add it names; `applied` counts every add and abort
applied so far (the loop reports it to its client with each push);
utility calls are not counted, since they do not travel on the client's
connection.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from rayvllm.messages.engine_types import AbortRequests, AddRequests, EngineCoreInput
from rayvllm.messages.request import EngineCoreRequest


class IntakeTarget(Protocol):
    """What takes the drained inputs: an engine core."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> object: ...


class UtilityTarget(Protocol):
    """What runs a utility call: an engine core."""

    def call_utility(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


@dataclass
class UtilityCall:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: Future[Any] = field(default_factory=Future)

    def run(self, target: UtilityTarget) -> None:
        """Call it on `target`; settle the future with the result or the error."""
        try:
            self.future.set_result(target.call_utility(self.method, self.args, self.kwargs))
        except Exception as e:  # noqa: BLE001 - the caller gets it
            self.future.set_exception(e)


class RequestIntake:
    def __init__(self) -> None:
        self._items: deque[EngineCoreInput | UtilityCall] = deque()
        self._arrived = threading.Condition()
        self._closed = False
        self._woken = False
        self.applied = 0

    # ---- any thread ----------------------------------------------------------------

    def put(self, item: EngineCoreInput | UtilityCall) -> None:
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

    def call_utility(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Future[Any]:
        """Queue a call of the core's `method`; its future holds the result
        (or the error it raised)."""
        call = UtilityCall(method, args, kwargs)
        self.put(call)
        return call.future

    def wake(self) -> None:
        """Wake the stepping thread with no input (the engine core has work
        again: a rebuilt DP rank)."""
        with self._arrived:
            self._woken = True
            self._arrived.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        """No more inputs will come (the client hung up), or the loop ended
        with `error`: utility calls still queued fail with it."""
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()
            if error is not None:
                for item in self._items:
                    if isinstance(item, UtilityCall) and not item.future.done():
                        item.future.set_exception(error)

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
        """Hand everything that has arrived to `core`, in arrival order, up
        to the first utility call."""
        while self._items and not isinstance(self._items[0], UtilityCall):
            item = self._items.popleft()
            if isinstance(item, AddRequests):
                core.add_requests(item.requests)
            else:
                assert isinstance(item, AbortRequests)
                core.abort_requests(item.request_ids)
            self.applied += 1

    def utility_next(self) -> bool:
        """A utility call is the next input."""
        return bool(self._items) and isinstance(self._items[0], UtilityCall)

    def take_utility(self) -> UtilityCall:
        """The next input, a utility call, taken out: its taker runs it
        (`UtilityCall.run`) or settles its future otherwise."""
        call = self._items.popleft()
        assert isinstance(call, UtilityCall)
        return call
