"""Just-in-time scheduling: `RequestIntake` and `EngineCore.step(intake)`.

Model-free: a fake executor holds each submitted step until the core asks
for its result, and can deliver a request "during" that step, the way the
SchedulerActor's intake thread does while a worker runs a forward."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from rayvllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rayvllm.core.sched.output import SchedulerOutput
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine.intake import IntakeStalledError, RequestIntake
from rayvllm.engine_types import ModelRunnerOutput
from rayvllm.executor.base import Executor
from rayvllm.request import EngineCoreRequest
from rayvllm.sampling_params import SamplingParams


def request(rid: str, max_tokens: int = 20) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[11, 12, 13], sampling_params=params, eos_token_id=None)


class RecordingCore:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.calls.append(("add", [r.request_id for r in requests]))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        self.calls.append(("abort", list(request_ids)))
        return list(request_ids)


def test_intake_drains_in_arrival_order_and_counts_every_message() -> None:
    intake = RequestIntake()
    assert not intake.has_pending_intake()
    intake.add_requests([request("a"), request("a-1")])
    intake.abort_requests(["a"])
    intake.add_requests([request("b")])
    assert intake.received == 3 and intake.has_pending_intake()
    core = RecordingCore()
    intake.drain_into(core)
    assert core.calls == [("add", ["a", "a-1"]), ("abort", ["a"]), ("add", ["b"])]
    assert intake.received == 3 and not intake.has_pending_intake()


def test_wait_for_returns_once_the_counted_messages_arrive() -> None:
    intake = RequestIntake()
    intake.wait_for(0, timeout_s=0.0)
    waiting = threading.Event()
    done = threading.Event()

    def waiter() -> None:
        waiting.set()
        intake.wait_for(2, timeout_s=60.0)
        done.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    waiting.wait()
    intake.add_requests([request("a")])
    assert not done.is_set()  # one of the two counted messages is not enough
    intake.abort_requests(["a"])
    thread.join(timeout=60.0)
    assert done.is_set()
    with pytest.raises(IntakeStalledError, match="counted 3 intake messages but only 2 arrived"):
        intake.wait_for(3, timeout_s=0.0)


class _Held:
    """A step on the fake worker; `result()` is when the core waits for it."""

    def __init__(self, executor: "HeldExecutor", so: SchedulerOutput) -> None:
        self.executor = executor
        self.so = so

    def result(self) -> ModelRunnerOutput:
        ex = self.executor
        ex.events.append(f"result {ex.steps.index(self.so)}")
        if ex.during_step is not None:
            arrive, ex.during_step = ex.during_step, None
            arrive()
        ids = list(self.so.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [7] * len(ids), None, {})

    def done(self) -> bool:
        return True  # the fake worker answers as soon as the core asks

    def wait_handles(self) -> list[object]:
        return []


class HeldExecutor(Executor):
    """Every scheduled request samples token 7 (prompts fit one step). Logs
    each submission and each wait in `events`; `during_step`, when set, runs
    once while the core waits for a step (an arrival mid-forward)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.steps: list[SchedulerOutput] = []
        self.events: list[str] = []
        self.during_step: Callable[[], None] | None = None

    def initialize(self) -> int:
        return 128  # blocks of 4 tokens: more than one max_model_len=256 sequence needs

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise AssertionError("the core submits steps with execute_model_async")

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> _Held:
        self.steps.append(scheduler_output)
        self.events.append(f"submit {len(self.steps) - 1}")
        return _Held(self, scheduler_output)

    def requests_in(self, step: int) -> list[str]:
        return sorted(self.steps[step].num_scheduled_tokens)


def make_core(*, async_scheduling: bool = True, max_num_seqs: int = 4) -> tuple[EngineCore, HeldExecutor]:
    config = EngineConfig(
        model_config=ModelConfig(
            model="fake", tokenizer="fake", dtype=torch.float32, max_model_len=256, seed=0, hf_config={}
        ),
        cache_config=CacheConfig(block_size=4, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256,
            async_scheduling=async_scheduling,
        ),
        parallel_config=ParallelConfig(),
    )
    executor = HeldExecutor(config)
    return EngineCore(config, executors=[executor]), executor


def test_a_light_engine_schedules_after_the_running_step_so_an_arrival_makes_the_next() -> None:
    core, ex = make_core()
    intake = RequestIntake()
    intake.add_requests([request("a")])
    ex.during_step = lambda: intake.add_requests([request("b")])
    outputs = core.step(intake)
    # Idle until now, so one call schedules step 0 and takes it back. Step 1
    # was scheduled only after step 0 ended, so "b" (which arrived during
    # step 0) is in it: its prefill runs beside "a"'s first decode.
    assert ex.events == ["submit 0", "result 0", "submit 1"]
    assert ex.requests_in(0) == ["a"] and ex.requests_in(1) == ["a", "b"]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [7])]
    ex.during_step = lambda: intake.add_requests([request("c")])
    outputs = core.step(intake)
    assert ex.events[3:] == ["result 1", "submit 2"]
    assert ex.requests_in(2) == ["a", "b", "c"]
    assert sorted((o.request_id, tuple(o.new_token_ids)) for o in outputs) == [("a", (7,)), ("b", (7,))]


def test_an_idle_step_with_nothing_to_run_returns_at_once() -> None:
    core, ex = make_core()
    assert core.step(RequestIntake()) == [] and ex.events == []


def test_a_saturated_engine_keeps_the_next_step_queued() -> None:
    """With requests waiting (max_num_seqs=1), step k+1 goes out before step
    k is waited for, as async scheduling does without an intake; an arrival
    during step k joins the queue behind the waiting request."""
    core, ex = make_core(max_num_seqs=1)
    intake = RequestIntake()
    intake.add_requests([request("a", max_tokens=3)])
    intake.add_requests([request("b", max_tokens=3)])
    core.step(intake)  # idle until now: "a" goes out alone and comes back, "b" waits
    assert ex.events == ["submit 0", "result 0", "submit 1"] and ex.requests_in(0) == ["a"]
    assert [r.request_id for r in core.scheduler.waiting] == ["b"]
    ex.during_step = lambda: intake.add_requests([request("c")])
    core.step(intake)
    assert ex.events[3:] == ["submit 2", "result 1"]
    assert ex.requests_in(2) == ["a"]
    core.step(intake)  # "c" was drained before this call scheduled
    assert [r.request_id for r in core.scheduler.waiting] == ["b", "c"]


def test_aborts_arriving_mid_step_take_effect_in_order() -> None:
    core, ex = make_core()
    intake = RequestIntake()
    intake.add_requests([request("a")])
    intake.add_requests([request("b")])
    ex.during_step = lambda: intake.abort_requests(["b"])
    outputs = core.step(intake)
    assert ex.requests_in(0) == ["a", "b"]
    assert ex.requests_in(1) == ["a"]  # "b" was aborted before step 1 was scheduled
    assert [o.request_id for o in outputs] == ["a"]  # its token from step 0 is dropped
    assert not core.scheduler.waiting and [r.request_id for r in core.scheduler.running] == ["a"]
    assert core.request_rank == {"a": 0}


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_without_an_intake_the_core_fills_first(async_scheduling: bool) -> None:
    core, ex = make_core(async_scheduling=async_scheduling)
    core.add_request(request("a"))
    core.step()
    core.step()
    if async_scheduling:
        assert ex.events == ["submit 0", "submit 1", "result 0", "submit 2", "result 1"]
    else:
        assert ex.events == ["submit 0", "result 0", "submit 1", "result 1"]


def test_the_inproc_client_queues_adds_and_aborts_until_its_step() -> None:
    """The in-process side of the client seam: adds and aborts from the
    serving loop wait in its intake (the core is untouched) until `step`,
    on the step thread, hands them over in order."""
    from rayvllm.engine.core_client import InprocClient

    core, ex = make_core(async_scheduling=False)
    client = InprocClient(core)
    client.add_requests([request("a", max_tokens=2)])
    client.add_requests([request("b", max_tokens=2)])
    client.abort_requests(["b"])
    assert client.has_pending_intake() and not core.has_unfinished_requests() and ex.steps == []
    outputs = client.step()
    assert not client.has_pending_intake()
    assert ex.requests_in(0) == ["a"]  # "b" was aborted before it was ever scheduled
    assert [o.request_id for o in outputs] == ["a"] and outputs[0].new_token_ids == [7]
