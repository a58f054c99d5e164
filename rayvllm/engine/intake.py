"""Requests and aborts that reach the engine core while a step runs.

On Ray the engine loop sends every add and abort to the SchedulerActor the
moment it has one, on a one-way channel; the channel's thread puts them
here and the core takes them right before it schedules (`EngineCore.step`),
so a request that arrives during a forward makes the very next step. The
in-process AsyncLLM keeps one too: its event loop puts, its step thread
drains between steps.

Invariants: messages are taken in the order they were sent, so an abort
never overtakes the add it names; `received` counts every message ever put,
so a step call that carries the sender's count can wait until everything
sent before it has arrived (the two channels are separate connections, and
nothing orders one against the other).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from rayvllm.request import EngineCoreRequest


class IntakeTarget(Protocol):
    """What takes the drained messages: an engine core."""

    def add_requests(self, requests: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> object: ...


class IntakeStalledError(RuntimeError):
    """A step call counted messages that never arrived."""


@dataclass(frozen=True)
class _Aborts:
    request_ids: list[str]


class RequestIntake:
    def __init__(self) -> None:
        # A request group (the children of one n > 1 request), or aborts.
        self._items: deque[list[EngineCoreRequest] | _Aborts] = deque()
        self._arrived = threading.Condition()
        self.received = 0

    # ---- the channel thread --------------------------------------------------------

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._put(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._put(_Aborts(request_ids))

    def _put(self, item: list[EngineCoreRequest] | _Aborts) -> None:
        with self._arrived:
            self._items.append(item)
            self.received += 1
            self._arrived.notify_all()

    # ---- the step thread -----------------------------------------------------------

    def wait_for(self, count: int, timeout_s: float) -> None:
        """Return once `count` messages have arrived in all."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self.received >= count, timeout_s):
                raise IntakeStalledError(
                    f"a step call counted {count} intake messages but only {self.received} arrived "
                    f"within {timeout_s:.0f} s"
                )

    def has_pending_intake(self) -> bool:
        return bool(self._items)

    def drain_into(self, core: IntakeTarget) -> None:
        """Hand everything that has arrived to `core`, in arrival order."""
        while self._items:
            item = self._items.popleft()
            if isinstance(item, _Aborts):
                core.abort_requests(item.request_ids)
            else:
                core.add_requests(item)
