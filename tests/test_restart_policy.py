"""The one restart policy (engine/restart_policy.py), model-free: a client
whose new cores fail as they start. A failed start is one more failure of
the kind that began the replacement: tried again until a core runs, and
the end only past the limit of failures in a row."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from rayvllm.engine.restart_policy import RestartPolicy
from rayvllm.frontend.output_processor import OutputProcessor
from rayvllm.messages.errors import EngineDeadError
from rayvllm.messages.request import EngineCoreRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _Client:
    """Each `restart` raises the next of `failures`, then succeeds."""

    can_restart = True

    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.held = False
        self.restarts: list[list[list[EngineCoreRequest]]] = []

    def hold(self) -> None:
        self.held = True

    def restart(self, requests: list[list[EngineCoreRequest]], shutdown_timeout_s: float) -> None:
        self.restarts.append(requests)
        if self.failures:
            raise self.failures.pop(0)


def _policy(client: _Client, tiny_tokenizer: "PreTrainedTokenizerBase") -> RestartPolicy:
    return RestartPolicy(client, OutputProcessor(tiny_tokenizer), backoff_s=0.0)


def test_a_start_that_fails_is_tried_again(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    client = _Client([RuntimeError("the new actor died"), RuntimeError("and again")])
    policy = _policy(client, tiny_tokenizer)
    failure = EngineDeadError("the scheduler actor is gone")
    assert policy.begin(failure) == [] and client.held and policy.restarting_since is not None
    policy.replace(failure)
    assert len(client.restarts) == 3 and policy.failed_starts == 2
    assert (policy.total, policy.restarting_since) == (1, None)


def test_past_the_limit_in_a_row_the_failure_ends_the_engine(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    client = _Client([RuntimeError("dies as it starts")] * 10)
    policy = _policy(client, tiny_tokenizer)
    failure = EngineDeadError("the scheduler actor is gone")
    policy.begin(failure)  # the first failure of the row
    with pytest.raises(EngineDeadError) as info:
        policy.replace(failure)
    assert info.value is failure and len(client.restarts) == policy.max_in_a_row
    assert (policy.total, policy.restarting_since) == (0, None)


def test_a_completed_step_starts_a_new_row(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    client = _Client([])
    policy = _policy(client, tiny_tokenizer)
    for _ in range(2 * policy.max_in_a_row):
        failure = EngineDeadError("killed")
        policy.begin(failure)
        policy.replace(failure)
        policy.step_done()
    assert policy.total == 2 * policy.max_in_a_row


def test_a_core_that_cannot_be_replaced_ends_at_once(tiny_tokenizer: "PreTrainedTokenizerBase") -> None:
    client = _Client([])
    client.can_restart = False
    failure = EngineDeadError("the in-process core failed")
    with pytest.raises(EngineDeadError) as info:
        _policy(client, tiny_tokenizer).begin(failure)
    assert info.value is failure and not client.held
