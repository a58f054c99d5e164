"""The loop that owns an engine core and pushes its outputs (vLLM's
`EngineCoreProc` busy loop): the one way a core is driven. The
SchedulerActor runs it for its client over a socket; in-process it runs
on a thread of the client's process over a local pipe (core_client.py).

The client never drives steps: it sends inputs (`AddRequests`,
`AbortRequests`) on one connection, in order, from any thread, and reads
`EngineCoreOutputs` pushed back on the same connection. The loop drains the
inputs, steps the core while it has work and pushes after a step, so
the next step is already running while the client turns the last one into
text; with nothing to do it blocks on the connection. A step with nothing
for the client (every running request `final_only`, no input applied)
pushes nothing unless the last push is `STATS_PUSH_PERIOD_S` old: on the
Ray path each push wakes the client's process, whose work then takes a
core from the forward (docs/BENCHMARKS.md).

Utility calls (the control plane: `collective_rpc`, weight updates, pause,
sleep) do not come on the connection: the client puts them in the intake
(`intake.call_utility`, from its own thread, or from a Ray call on the
SchedulerActor) and waits for their future. When one is next, the loop
takes back every step in flight (pushing their outputs), runs it on this
thread, and pushes once more, so a client blocked in `step` wakes. A
utility that waits on someone outside the engine (`BACKGROUND_UTILITIES`:
a weight-transfer group forming, for as long as its timeout) runs on a
thread beside the steps instead, when the loop has a thread of its own:
requests are served meanwhile, and until it returns any other utility
that would reach the workers fails at once, naming it.

Ray-free: it is handed a connected `CoreConnection` (local_pipe.py).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

from rayvllm.engine.engine_core import BACKGROUND_UTILITIES, CORE_ONLY_UTILITIES, EngineCore
from rayvllm.engine.intake import RequestIntake, UtilityCall
from rayvllm.engine.local_pipe import CoreConnection
from rayvllm.messages.engine_types import EngineCoreFailure, EngineCoreInput, EngineCoreOutputs, SchedulerStats
from rayvllm.messages.errors import EngineDeadError, InvalidParameterError, StepFailedError

logger = logging.getLogger(__name__)

# The longest a stepping loop goes without a push: the stats and block
# events it carries (metrics, the KV-aware router's view) are never older.
STATS_PUSH_PERIOD_S = 0.1


class EngineCoreLoop:
    """Invariants: inputs are applied in the order the client sent them,
    each before the first step scheduled after its arrival; a push carries
    the count of inputs applied so far, and a step is followed by one
    whenever it has outputs, applied an input since the last push, or the
    last push is `STATS_PUSH_PERIOD_S` old; with no work and no input the
    loop blocks, never spins. It ends when the client hangs up; on an
    error it pushes `EngineCoreFailure` first."""

    def __init__(self, core: EngineCore, conn: CoreConnection) -> None:
        self.core = core
        self.conn = conn
        self.intake = RequestIntake()
        self._pushed_applied = -1  # `intake.applied` as of the last push
        self._pushed_at = 0.0  # time.monotonic() of the last push
        # Set by `run`: the loop then owns its thread, and a background
        # utility may run beside it (see the module's docstring).
        self._owns_thread = False
        self._beside: tuple[UtilityCall, threading.Thread] | None = None

    def run(self) -> None:
        """Serve until the client hangs up (on the calling thread, one of
        its own: a reader thread takes the inputs meanwhile)."""
        reader = threading.Thread(target=self._read, name="rayvllm-core-input", daemon=True)
        reader.start()
        self._owns_thread = True
        try:
            self.open()
            while not self.intake.closed:
                if not self._has_work():
                    if not self.intake.wait_for_input():
                        break
                self._turn()
        except (EOFError, OSError):
            pass  # the client is gone; nobody is left to tell
        except BaseException as e:  # noqa: BLE001 - the client must hear why
            self._fail(e)
        finally:
            self.conn.close()
            self.intake.close(EngineDeadError("the engine loop ended"))

    def open(self) -> None:
        """The first push: the core's stats before any step."""
        self._push(EngineCoreOutputs([], self._stats(), 0))

    def run_once(self) -> None:
        """One turn of `run` on the caller's thread (the offline engine,
        whose caller waits for every step anyway): take the inputs that have
        arrived, then step and push if there is work. An error is pushed as
        `run` pushes it, and ends the loop."""
        try:
            while self.conn.poll():
                self._take(self.conn.recv())
            if self._has_work():
                self._turn()
        except (EOFError, OSError):
            self.conn.close()
            self.intake.close(EngineDeadError("the engine loop ended"))
        except BaseException as e:  # noqa: BLE001 - the client must hear why
            self._fail(e)
            self.conn.close()
            self.intake.close(EngineDeadError(f"the engine loop failed: {e!r}"))

    def _has_work(self) -> bool:
        return self.core.has_work() or self.intake.has_pending_intake()

    def _turn(self) -> None:
        """A step, or the utility call that is next once no step is in flight."""
        if not self.intake.utility_next():
            self._step()
            return
        call = self.intake.take_utility()
        if self._beside is not None and self._beside[1].is_alive() and call.method not in CORE_ONLY_UTILITIES:
            running = self._beside[0].method
            call.future.set_exception(InvalidParameterError(
                "method", f"{call.method} cannot run until {running} returns (it waits for its group to form, "
                "at most its timeout_s)",
            ))
            return
        if self._owns_thread and call.method in BACKGROUND_UTILITIES:
            thread = threading.Thread(target=call.run, args=(self.core,), name=f"rayvllm-{call.method}", daemon=True)
            self._beside = (call, thread)
            thread.start()
            return
        if self.core.has_inflight():
            self._push(EngineCoreOutputs(self.core.finish_inflight(), self._stats(), self.intake.applied))
        call.run(self.core)
        self._push(EngineCoreOutputs([], self._stats(), self.intake.applied))

    def _step(self) -> None:
        outputs = self.core.step(self.intake)
        if (
            outputs
            or self.intake.applied != self._pushed_applied
            or time.monotonic() - self._pushed_at >= STATS_PUSH_PERIOD_S
        ):
            self._push(EngineCoreOutputs(outputs, self._stats(), self.intake.applied))

    def _stats(self) -> SchedulerStats:
        """Each push carries the block events since the previous one."""
        stats = self.core.make_stats()
        stats.block_events = self.core.take_block_events()
        return stats

    def _fail(self, error: BaseException) -> None:
        logger.exception("engine loop failed")
        culprits = error.culprits if isinstance(error, StepFailedError) else []
        try:
            self._push(EngineCoreFailure(f"{error!r}\n{traceback.format_exc()}", culprits))
        except OSError:
            pass

    def _push(self, message: EngineCoreOutputs | EngineCoreFailure) -> None:
        self.conn.send(message)
        if isinstance(message, EngineCoreOutputs):
            self._pushed_applied = message.inputs_applied
            self._pushed_at = time.monotonic()

    def _take(self, message: EngineCoreInput | list[EngineCoreInput]) -> None:
        if isinstance(message, list):
            self.intake.put_all(message)  # sent together: applied together
        else:
            self.intake.put(message)

    def _read(self) -> None:
        try:
            while True:
                self._take(self.conn.recv())
        except (EOFError, OSError):
            pass
        finally:
            self.intake.close()
