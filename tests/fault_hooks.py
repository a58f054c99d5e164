"""Faults injected into Ray worker processes for tests/test_fault_tolerance.py
(installed by runtime_env's `worker_process_setup_hook`): a request with
`POISON_SEED` makes the model runner raise in its step, on a worker that
stays alive, as a bug triggered by one request's data would."""

from __future__ import annotations

from typing import Any

POISON_SEED = 666


def poison_seed() -> None:
    from rayvllm.model_executor import model_runner

    original = model_runner.ModelRunner._update_states

    def update_states(self: Any, so: Any) -> None:
        for new in so.scheduled_new_reqs:
            if new.sampling_params.seed == POISON_SEED:
                raise RuntimeError("a poisoned request")
        original(self, so)

    model_runner.ModelRunner._update_states = update_states


HANG_SEED = 777
# The file that marks the hang as done: set by the test in the workers' environment.
HANG_FLAG_ENV = "RAYVLLM_TEST_HANG_FLAG"


def hang_once() -> None:
    """A request with `HANG_SEED` hangs its step, once per flag file: a
    transient wedge (a stuck collective, say) that a new engine does not meet."""
    import os
    import threading

    from rayvllm.model_executor import model_runner

    original = model_runner.ModelRunner._update_states

    def update_states(self: Any, so: Any) -> None:
        flag = os.environ.get(HANG_FLAG_ENV)
        for new in so.scheduled_new_reqs:
            if new.sampling_params.seed == HANG_SEED and flag and not os.path.exists(flag):
                open(flag, "w").close()
                threading.Event().wait()  # forever
        original(self, so)

    model_runner.ModelRunner._update_states = update_states


# The file that arms `die_in_start`: set by the test in the workers' environment.
DIE_IN_START_FLAG_ENV = "RAYVLLM_TEST_DIE_IN_START_FLAG"


def die_in_start() -> None:
    """The next engine core built after the test creates the flag file
    (the replacement SchedulerActor's `start`) kills its own process: a
    death during recovery. One process claims the flag (by removing it)."""
    import os
    import signal

    from rayvllm.engine import engine_core

    original = engine_core.EngineCore.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        flag = os.environ.get(DIE_IN_START_FLAG_ENV)
        if flag:
            try:
                os.remove(flag)
            except FileNotFoundError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        original(self, *args, **kwargs)

    engine_core.EngineCore.__init__ = init


def install() -> None:
    """Every fault of this file (each triggered only by its own seed or flag)."""
    poison_seed()
    hang_once()
    die_in_start()
