"""`InprocClient`: the engine core and its loop in this process, over a
local pipe (core_client.py has the client's contract)."""

from __future__ import annotations

import threading
from typing import Any

import torch

from rayvllm.config import EngineConfig
from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.engine.core_loop import EngineCoreLoop
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine.local_pipe import CoreConnection, local_pipe
from rayvllm.executor.base import ExecutorFactory
from rayvllm.messages.engine_types import EngineCoreOutput
from rayvllm.messages.errors import EngineDeadError


class InprocClient(EngineCoreClient):
    """The core and its loop in this process, over a local pipe.
    `engine_core` (vLLM's name) is the core, for tests and tools to
    inspect; only the loop's thread changes it.

    `threaded`: the loop runs on a thread of its own (the serving engine,
    whose event loop must never wait for a step). Otherwise `step` runs one
    turn of the same loop on the caller's thread (the offline engine, whose
    caller waits for every step anyway: a second thread there only takes
    the GIL and a core from the forward; docs/BENCHMARKS.md)."""

    # The core shares this process: what ended it is no worker's fault
    # that a new one would escape.
    can_restart = False

    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory, threaded: bool = True) -> None:
        super().__init__(config)
        self.executor_factory = executor_factory
        self.threaded = threaded
        self.engine_core: EngineCore | None = None
        self._loop_thread: threading.Thread | None = None
        self._inline_loop: EngineCoreLoop | None = None
        self._loop: EngineCoreLoop | None = None
        self._start()

    def _launch(self) -> CoreConnection:
        core = self.engine_core = EngineCore(self.config, self.executor_factory)
        client_end, loop_end = local_pipe()
        loop = self._loop = EngineCoreLoop(core, loop_end)
        if not self.threaded:
            self._inline_loop = loop
            loop.open()
            return client_end
        # torch's thread count is per thread: the loop runs the forwards
        # with this thread's.
        num_threads = torch.get_num_threads()

        def run() -> None:
            torch.set_num_threads(num_threads)
            loop.run()

        self._loop_thread = threading.Thread(target=run, name="rayvllm-engine-loop", daemon=True)
        self._loop_thread.start()
        return client_end

    def step(self) -> list[EngineCoreOutput]:
        loop = self._inline_loop
        if loop is not None and not self._ready():
            loop.run_once()
            if not self._ready():
                return []  # no work, or a step with nothing for us: no push
        return super().step()

    def _release(self, timeout_s: float) -> None:
        # The loop ends at the hang-up (after the step it is in); the core
        # is shut down only after it, on this thread.
        if self._loop_thread is not None:
            self._loop_thread.join()
            self._loop_thread = None
        self._inline_loop = None
        self._loop = None
        if self.engine_core is not None:
            self.engine_core.shutdown()
            self.engine_core = None

    def check_health(self) -> None:
        core = self.engine_core
        if core is None:
            raise EngineDeadError("the engine core was shut down")
        core.check_health()

    def kill(self) -> None:
        pass  # the step runs on a thread of this process; nothing can end it

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        loop = self._loop
        if loop is None:
            raise EngineDeadError("the engine core was shut down")
        future = loop.intake.call_utility(method, args, kwargs)
        if self._inline_loop is not None:
            while not future.done() and not loop.intake.closed:
                loop.run_once()
        return future.result()

    def share_weights(self, weights: Any) -> Any:
        return weights  # the workers are in this process

    def transfer_address(self) -> str:
        return "127.0.0.1"
