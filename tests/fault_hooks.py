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


def install() -> None:
    """Every fault of this file (each triggered only by its own seed)."""
    poison_seed()
    hang_once()
