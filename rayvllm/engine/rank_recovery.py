"""Rebuilding one data-parallel rank's worker group while the others serve.

With data parallelism a dead worker costs its own rank only: the engine
core moves the rank's requests onto a fresh scheduler (to be recomputed
from prompt plus emitted tokens, as a preemption would) and hands the dead
group to a `RankRecovery`, which tears it down and starts a new one on a
thread of its own, so the loop keeps stepping every other rank meanwhile.
The loop installs the new group when the thread is done. A new group that
fails as it starts is tried again under the engine's restart rule
(`RestartLimits`); past its limit the rank's failure ends the core, which
the client's `RestartPolicy` then replaces.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from rayvllm.engine.restart_policy import RestartLimits
from rayvllm.executor.base import Executor
from rayvllm.messages.errors import EngineDeadError

logger = logging.getLogger(__name__)


class RankRecovery:
    """Invariants: `executor` is set only when the new group holds at least
    `min_blocks` KV blocks; otherwise `error` says why. `on_done` runs once,
    on the recovery thread, after either is set. A cancelled recovery shuts
    down whatever group it built."""

    def __init__(
        self, dp_rank: int, dead: Executor, factory: Callable[[], Executor], min_blocks: int,
        on_done: Callable[[], None], limits: RestartLimits, cause: BaseException,
    ) -> None:
        self.dp_rank = dp_rank
        self.executor: Executor | None = None
        self.error: BaseException | None = None
        self._dead = dead
        self._factory = factory
        self._min_blocks = min_blocks
        self._on_done = on_done
        self._limits = limits
        self._cause = cause
        self._done = threading.Event()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name=f"rayvllm-rebuild-dp{dp_rank}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def cancel(self) -> None:
        self._cancelled = True
        if self.done() and self.executor is not None:
            self.executor.shutdown()

    def _run(self) -> None:
        try:
            self._dead.shutdown()
            failure = EngineDeadError(f"DP rank {self.dp_rank} lost its worker group: {self._cause!r}")
            self.executor = self._limits.start_until_running(
                self._start, failure, f"worker group of DP rank {self.dp_rank}"
            )
            logger.warning("DP rank %d: worker group rebuilt", self.dp_rank)
        except BaseException as e:  # noqa: BLE001 - reported to the loop, which ends the engine
            self.error = e
            logger.exception("DP rank %d: rebuilding the worker group failed", self.dp_rank)
        finally:
            self._done.set()
            if self._cancelled and self.executor is not None:
                self.executor.shutdown()
            self._on_done()

    def _start(self) -> Executor:
        executor = self._factory()
        try:
            num_blocks = executor.initialize()
            if num_blocks < self._min_blocks:
                raise RuntimeError(
                    f"the new worker group holds {num_blocks} KV blocks, fewer than the "
                    f"{self._min_blocks} the rank's block pool addresses"
                )
        except BaseException:
            executor.shutdown()
            raise
        return executor
