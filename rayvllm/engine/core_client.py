"""The one client of an engine core, whatever runs it: `AsyncLLM`,
`LLMEngine` and the offline `LLM` hold an `EngineCoreClient` and never ask
which kind.

Either way the core is driven by its own loop (core_loop.py), never by the
client: inputs (`AddRequests`, `AbortRequests`) go out on one connection
the moment the caller makes them, from any thread, in order; the loop
pushes `EngineCoreOutputs` on its own after each step that has something
for the client, so `step` here only reads what was pushed, and the loop's
next step already runs while the caller turns the last one into text.
Stats ride along with every push; `make_stats` costs no round trip. A new request's full data goes out once;
the loop's steps then send the workers deltas.

`InprocClient` (inproc_client.py) runs the loop in this process over a
local pipe (on a thread of its own, or turn by turn on the offline
caller's thread); the Ray client (rayvllm.actors) runs it in a
SchedulerActor over a socket. Which one is built is decided above this
package and injected. This module imports neither torch nor the core, so
a front end whose core runs elsewhere loads neither.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.engine.local_pipe import CoreConnection
from rayvllm.messages.engine_types import (
    AbortRequests,
    AddRequests,
    EngineCoreFailure,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    KVOffloadStats,
    PrefixCacheStats,
    SchedulerStats,
)
from rayvllm.messages.errors import EngineDeadError, StepFailedError
from rayvllm.messages.request import EngineCoreRequest


class EngineCoreClient(ABC):
    """`add_requests`, `abort_requests`, `has_pending_intake` and `hold`
    may be called from any thread, also while another is in `step`;
    `step`, `make_stats` and `restart` from the one thread that steps.

    Invariants: inputs reach the loop in the order they were made; while
    held (from `hold` until `restart` succeeds) they wait here, in order,
    and go to the new core after the resumed requests."""

    # Whether a dead core can be replaced by a new one (`restart`).
    can_restart = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._send_lock = threading.Lock()
        self._held: list[EngineCoreInput] | None = None
        self.conn: CoreConnection | None = None
        # The routing keys of the blocks the core caches, as its block
        # events tell them (each new core's first push resets them).
        self.cached_block_keys: set[bytes] = set()

    # ---- what a kind of core provides ------------------------------------------------

    @abstractmethod
    def _launch(self) -> CoreConnection:
        """Start a core and its loop; the connection to the loop, whose
        first push (stats before any step) is still unread."""

    @abstractmethod
    def _release(self, timeout_s: float) -> None:
        """After the connection was closed: end the core (waiting up to
        `timeout_s` for it to shut down cleanly) and free what it held.
        Also for a core that is dead already or never started fully."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if the core or any of its workers is dead."""

    @abstractmethod
    def kill(self) -> None:
        """End a hung core at once, from any thread: a `step` waiting on it
        raises `EngineDeadError`. (A core on a thread of this process cannot
        be ended under its own step; there this does nothing.)"""

    # The control plane (docs/RL.md); a kind of core without it (a test's
    # scripted loop) leaves these to raise.

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run the core's utility `method` (`EngineCore.call_utility`) once
        no step is in flight, and return its result or raise its error;
        blocks until then. Any thread but the one that steps (the offline
        engine's own loop turns on the calling thread until it is done)."""
        raise NotImplementedError(f"{type(self).__name__} has no control plane")

    def share_weights(self, weights: Any) -> Any:
        """Weights (a dict of tensors, its `HostWeights`, or a Ray object ref
        to either) as the core's workers can fetch them: as they are for a
        core in this process; put in the object store once, as
        `HostWeights`, for a core on Ray."""
        raise NotImplementedError(f"{type(self).__name__} has no control plane")

    def transfer_address(self) -> str:
        """The address at which the core's workers reach this process (to
        join a weight-transfer group it hosts)."""
        raise NotImplementedError(f"{type(self).__name__} has no control plane")

    # ---- lifecycle -------------------------------------------------------------------

    def _start(self) -> None:
        conn = self._launch()
        self.conn = conn
        self._sent = 0  # inputs sent so far
        # Request id -> the number of its add among the inputs sent, until a
        # push reports it applied: outputs for that id in an earlier push are
        # the previous request of the same id, finished here already.
        self._added_at: dict[str, int] = {}
        self._applied = 0  # of those, how many the loop has applied (as of its latest push)
        self._prefix_stats = PrefixCacheStats()  # pushed since the last `make_stats`
        self._offload_stats: KVOffloadStats | None = None  # likewise
        self._stats: SchedulerStats | None = None
        self._recv()  # the loop's first push: its stats before any step

    def hold(self) -> None:
        """Keep inputs here from now on, for the core that `restart` starts
        (the table-owning thread calls it as it takes the requests to resume)."""
        with self._send_lock:
            if self._held is None:
                self._held = []

    def restart(self, requests: list[list[EngineCoreRequest]], shutdown_timeout_s: float) -> None:
        """Replace the core (dead, or alive but failed) by a new one, add
        `requests` to it (each list as one `add_requests`), then the inputs
        held meanwhile. Raises what the start raised (the new core may die
        too); the held inputs then stay held for the next try."""
        self.hold()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
            self._release(shutdown_timeout_s)
        try:
            self._start()
        except BaseException:
            if self.conn is not None:
                self.conn.close()
                self.conn = None
            self._release(0.0)
            raise
        with self._send_lock:
            held = self._held or []
            self._send_now([AddRequests(list(group)) for group in requests] + held)
            self._held = None

    def shutdown(self) -> None:
        if self.conn is None:
            return
        self.conn.close()  # the loop sees the end and stops
        self.conn = None
        self._release(60.0)

    # ---- inputs (any thread) ---------------------------------------------------------

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(list(requests)))

    def add_request_groups(self, groups: list[list[EngineCoreRequest]]) -> None:
        """Several `add_requests` at once: the core applies all of them
        before the same step (the offline engine's batch)."""
        if groups:
            self._send([AddRequests(list(group)) for group in groups])

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        ids = list(request_ids)
        if ids:
            self._send(AbortRequests(ids))
        return ids

    def _send(self, message: EngineCoreInput | list[EngineCoreInput]) -> None:
        with self._send_lock:
            if self._held is not None:
                self._held += message if isinstance(message, list) else [message]
                return
            self._send_now(message)

    def _send_now(self, message: EngineCoreInput | list[EngineCoreInput]) -> None:
        """Under the send lock. A list goes as one message: the loop takes
        its inputs into its intake together."""
        conn = self.conn
        try:
            if conn is None:
                raise OSError("no engine core")
            conn.send(message)
        except OSError as e:
            raise EngineDeadError(f"the engine core is gone: {e!r}") from e
        for item in message if isinstance(message, list) else [message]:
            self._sent += 1
            if isinstance(item, AddRequests):
                for request in item.requests:
                    self._added_at[request.request_id] = self._sent

    def has_pending_intake(self) -> bool:
        """Inputs were made that the loop has not reported applied."""
        return self._sent > self._applied or bool(self._held)

    # ---- outputs (the stepping thread) -----------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """The outputs pushed since the last call, waiting for one push if
        none has arrived. Call it only while requests are unfinished or
        inputs pending: an idle loop pushes nothing."""
        outputs = self._recv()
        while self._ready():
            outputs += self._recv()
        return outputs

    def _ready(self) -> bool:
        assert self.conn is not None
        try:
            return self.conn.poll()
        except (EOFError, OSError):
            return True  # `_recv` raises the error

    def _recv(self) -> list[EngineCoreOutput]:
        conn = self.conn
        try:
            if conn is None:
                raise EOFError("no engine core")
            message = conn.recv()
        except (EOFError, OSError) as e:
            raise EngineDeadError(f"the engine core is gone: {e!r}") from e
        if isinstance(message, EngineCoreFailure):
            if message.culprits:
                raise StepFailedError(f"the engine loop failed: {message.error}", message.culprits)
            raise EngineDeadError(f"the engine loop failed: {message.error}")
        assert isinstance(message, EngineCoreOutputs)
        self._applied = applied = message.inputs_applied
        outputs = message.outputs
        if self._added_at:
            with self._send_lock:
                outputs = [o for o in outputs if self._added_at.get(o.request_id, 0) <= applied]
                self._added_at = {rid: n for rid, n in self._added_at.items() if n > applied}
        self._stats = message.scheduler_stats
        events = message.scheduler_stats.block_events
        if events is not None:
            if events.reset:
                self.cached_block_keys = set()
            self.cached_block_keys.difference_update(events.evicted)
            self.cached_block_keys.update(events.stored)
        self._prefix_stats.add(message.scheduler_stats.prefix_cache_stats)
        offload = message.scheduler_stats.kv_offload_stats
        if offload is not None:
            self._offload_stats = self._offload_stats or KVOffloadStats()
            self._offload_stats.add(offload)
        return outputs

    @property
    def latest_stats(self) -> SchedulerStats | None:
        """The latest push's stats, read without consuming anything."""
        return self._stats

    def make_stats(self) -> SchedulerStats:
        """The gauges as of the latest push, with the prefix-cache counts of
        every push since the previous call (each counted exactly once)."""
        assert self._stats is not None
        prefix, self._prefix_stats = self._prefix_stats, PrefixCacheStats()
        offload, self._offload_stats = self._offload_stats, None
        return dataclasses.replace(self._stats, prefix_cache_stats=prefix, kv_offload_stats=offload, block_events=None)
