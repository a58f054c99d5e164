"""Just-in-time scheduling (`RequestIntake`, `EngineCore.step(intake)`) and
the engine loop that owns a core and pushes its outputs (`EngineCoreLoop`).

Model-free: a fake executor holds each submitted step until the core asks
for its result, and can deliver a request "during" that step, the way the
SchedulerActor's intake thread does while a worker runs a forward."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import pytest

from rayvllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.engine import core_loop
from rayvllm.engine.core_loop import EngineCoreLoop
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine.intake import RequestIntake
from rayvllm.engine.local_pipe import LocalConnection, local_pipe
from rayvllm.executor.base import Executor
from rayvllm.messages.engine_types import (
    AbortRequests,
    AddRequests,
    EngineCoreFailure,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    PrefixCacheStats,
    SchedulerStats,
)
from rayvllm.messages.request import EngineCoreRequest, FinishReason
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.scheduler_output import SchedulerOutput


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


def test_intake_drains_in_arrival_order_and_counts_what_it_applied() -> None:
    intake = RequestIntake()
    assert not intake.has_pending_intake()
    intake.add_requests([request("a"), request("a-1")])
    intake.abort_requests(["a"])
    intake.add_requests([request("b")])
    assert intake.applied == 0 and intake.has_pending_intake()
    core = RecordingCore()
    intake.drain_into(core)
    assert core.calls == [("add", ["a", "a-1"]), ("abort", ["a"]), ("add", ["b"])]
    assert intake.applied == 3 and not intake.has_pending_intake()


def test_wait_for_input_wakes_on_a_put_and_on_close() -> None:
    intake = RequestIntake()
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(intake.wait_for_input()))
    thread.start()
    intake.abort_requests(["a"])
    thread.join(timeout=60.0)
    assert results == [True]
    intake.drain_into(RecordingCore())
    thread = threading.Thread(target=lambda: results.append(intake.wait_for_input()))
    thread.start()
    intake.close()
    thread.join(timeout=60.0)
    assert results == [True, False] and intake.closed


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
            model="fake", tokenizer="fake", dtype="float32", max_model_len=256, seed=0,
            hf_config={"num_hidden_layers": 1},
        ),
        cache_config=CacheConfig(block_size=4, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256,
            async_scheduling=async_scheduling,
        ),
        parallel_config=ParallelConfig(),
    )
    executor = HeldExecutor(config)
    return EngineCore(config, lambda rank: executor), executor


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


def test_the_inproc_client_drives_the_core_through_its_loop_on_a_thread() -> None:
    """In-process, the same loop as on the SchedulerActor owns the core, on
    a thread: the client only sends inputs and reads what was pushed."""
    from rayvllm.engine.inproc_client import InprocClient

    _, ex = make_core(async_scheduling=False)
    client = InprocClient(ex.config, lambda rank: ex)
    try:
        assert client.make_stats().num_running_reqs == 0  # the loop's first push
        client.add_requests([request("a", max_tokens=2)])
        tokens: list[int] = []
        while not tokens or len(tokens) < 2:
            tokens += [t for out in client.step() for t in out.new_token_ids]
        assert tokens == [7, 7] and not client.has_pending_intake()
        assert [ex.requests_in(i) for i in range(len(ex.steps))] == [["a"], ["a"]]
        assert threading.current_thread() is not client._loop_thread
    finally:
        client.shutdown()
    assert client.engine_core is None


def test_the_offline_client_turns_the_same_loop_on_the_callers_thread() -> None:
    """`threaded=False` (the offline engine): no loop thread; each `step`
    runs one turn of the loop here (inputs taken, one core step, its push),
    and an idle loop returns nothing rather than waiting for a push."""
    from rayvllm.engine.inproc_client import InprocClient

    _, ex = make_core(async_scheduling=False)
    client = InprocClient(ex.config, lambda rank: ex, threaded=False)
    try:
        assert client._loop_thread is None
        assert client.make_stats().num_running_reqs == 0  # the loop's first push
        client.add_requests([request("a", max_tokens=2)])
        assert ex.steps == []  # nothing runs until the caller steps
        tokens = [t for out in client.step() for t in out.new_token_ids]
        assert tokens == [7] and len(ex.steps) == 1 and not client.has_pending_intake()
        tokens += [t for out in client.step() for t in out.new_token_ids]
        assert tokens == [7, 7] and len(ex.steps) == 2
        assert client.step() == [] and len(ex.steps) == 2  # idle: no step, no wait
        client.abort_requests(["gone"])
        assert client.has_pending_intake()
        client.step()  # the abort is applied by a turn of its own
        assert not client.has_pending_intake()
    finally:
        client.shutdown()
    assert client.engine_core is None


# ---- the engine loop that owns the core (core_loop.py) -------------------------------


def _run_loop(core: EngineCore) -> tuple[LocalConnection, threading.Thread]:
    client, server = local_pipe()
    thread = threading.Thread(target=EngineCoreLoop(core, server).run, name="test-engine-loop")
    thread.start()
    return client, thread


def test_the_engine_loop_pushes_once_per_step_and_blocks_when_idle() -> None:
    core, ex = make_core(async_scheduling=False)
    conn, thread = _run_loop(core)
    first = conn.recv()
    assert first.outputs == [] and first.inputs_applied == 0 and first.scheduler_stats.num_running_reqs == 0
    conn.send(AddRequests([request("a", max_tokens=3)]))
    pushes: list[EngineCoreOutputs] = []
    while not any(o.finished for p in pushes for o in p.outputs):
        pushes.append(conn.recv())
    assert [t for p in pushes for o in p.outputs for t in o.new_token_ids] == [7, 7, 7]
    assert len(pushes) == len(ex.steps) == 3 and all(p.inputs_applied == 1 for p in pushes)
    assert pushes[-1].scheduler_stats.num_running_reqs == 0
    # Idle now: nothing more comes until the next input, which gets its push.
    conn.send(AbortRequests(["gone"]))
    ack = conn.recv()
    assert ack.outputs == [] and ack.inputs_applied == 2
    conn.close()  # the client hangs up: the loop ends
    thread.join(timeout=60.0)
    assert not thread.is_alive()


def test_steps_of_final_only_requests_push_only_a_first_token_and_an_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with nothing for the client pushes nothing (unless the last
    push is a period old): the first token, then the rest with the end."""
    monkeypatch.setattr(core_loop, "STATS_PUSH_PERIOD_S", 3600.0)
    core, ex = make_core(async_scheduling=False)
    conn, thread = _run_loop(core)
    conn.recv()
    conn.send(AddRequests([replace(request("q", max_tokens=5), final_only=True)]))
    first = conn.recv()
    assert [(o.new_token_ids, o.finish_reason) for o in first.outputs] == [([7], None)]
    assert first.inputs_applied == 1 and first.outputs[0].first_scheduled_time is not None
    last = conn.recv()
    assert [(o.new_token_ids, o.finish_reason) for o in last.outputs] == [([7, 7, 7, 7], FinishReason.LENGTH)]
    assert len(ex.steps) == 5 and last.scheduler_stats.num_running_reqs == 0
    # Stats are never older than the period: at 0, every step pushes again.
    monkeypatch.setattr(core_loop, "STATS_PUSH_PERIOD_S", 0.0)
    conn.send(AddRequests([replace(request("r", max_tokens=3), final_only=True)]))
    pushes = [conn.recv() for _ in range(3)]
    assert [[o.new_token_ids for o in p.outputs] for p in pushes] == [[[7]], [], [[7, 7]]]
    assert len(ex.steps) == 8
    conn.close()
    thread.join(timeout=60.0)
    assert not thread.is_alive()


def test_a_failing_step_is_the_loops_last_push() -> None:
    core, ex = make_core(async_scheduling=False)
    conn, thread = _run_loop(core)
    conn.recv()

    def fail() -> None:
        raise RuntimeError("the worker broke")

    ex.during_step = fail
    conn.send(AddRequests([request("a")]))
    message = conn.recv()
    assert isinstance(message, EngineCoreFailure) and "the worker broke" in message.error
    thread.join(timeout=60.0)
    assert not thread.is_alive()
    with pytest.raises(EOFError):
        conn.recv()


# ---- the client: a request id used again -------------------------------------------


class _ScriptedLoop(EngineCoreClient):
    """A client whose loop is the test: it reads the inputs and writes the pushes."""

    def __init__(self) -> None:
        self.loop_end: LocalConnection | None = None
        super().__init__(make_core(async_scheduling=False)[1].config)
        self._start()

    def _launch(self) -> LocalConnection:
        client_end, self.loop_end = local_pipe()
        self.loop_end.send(_push([], applied=0))
        return client_end

    def _release(self, timeout_s: float) -> None:
        pass

    def check_health(self) -> None:
        pass

    def kill(self) -> None:
        pass


def _push(outputs: list[EngineCoreOutput], applied: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs, SchedulerStats(0, 0, 0.0, PrefixCacheStats(), 0), applied)


def test_outputs_of_an_earlier_request_of_the_same_id_are_dropped() -> None:
    """A request id used again at once (the first request finished here by
    a stop string while the loop ran on): outputs pushed before the new
    add was applied are the old request's and never reach the new one."""
    client = _ScriptedLoop()
    assert client.loop_end is not None
    client.add_requests([request("a")])
    client.loop_end.send(_push([EngineCoreOutput("a", [1])], applied=0))  # the old "a"
    client.loop_end.send(_push([EngineCoreOutput("a", [2]), EngineCoreOutput("b", [3])], applied=1))
    assert [(o.request_id, o.new_token_ids) for o in client.step()] == [("a", [2]), ("b", [3])]
    client.loop_end.send(_push([EngineCoreOutput("a", [4])], applied=1))
    assert [o.new_token_ids for o in client.step()] == [[4]]
