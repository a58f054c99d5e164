"""StepPacer and `EngineCore.next_step_delay`: when the engine loop sends its
next step call under async scheduling. Model-free: a fake executor reports
the worker timings the pacer reads."""

from __future__ import annotations

import pytest
import torch

from rayvllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rayvllm.core.sched.output import SchedulerOutput
from rayvllm.engine.engine_core import EngineCore
from rayvllm.engine.step_pacer import INITIAL_LEAD_S, LEAD_DECAY, MIN_LEAD_S, StepPacer
from rayvllm.executor.base import Executor
from rayvllm.request import EngineCoreRequest
from rayvllm.sampling_params import SamplingParams
from rayvllm.worker.outputs import ModelRunnerOutput


def timed(busy_s: float, idle_s: float = 0.0) -> ModelRunnerOutput:
    return ModelRunnerOutput([], [], None, {}, busy_s=busy_s, idle_s=idle_s)


def test_no_estimate_no_delay() -> None:
    pacer = StepPacer()
    assert pacer.delay(0.0) == 0.0
    pacer.observe(timed(0.0), decode_only=True, paced=False)  # an untimed executor
    assert pacer.delay(0.0) == 0.0
    pacer.observe(timed(0.040), decode_only=False, paced=False)  # prefill steps set no estimate
    assert pacer.delay(0.0) == 0.0


def test_delay_is_estimate_minus_elapsed_minus_lead() -> None:
    pacer = StepPacer()
    pacer.observe(timed(0.020), decode_only=True, paced=False)
    assert pacer.delay(0.005) == pytest.approx(0.020 - 0.005 - INITIAL_LEAD_S)
    assert pacer.delay(0.019) == 0.0  # never negative
    pacer.observe(timed(0.028), decode_only=True, paced=False)
    assert pacer.busy_s == pytest.approx(0.022)  # EMA, alpha 0.25
    pacer.observe(timed(0.100), decode_only=False, paced=False)
    assert pacer.busy_s == pytest.approx(0.022)  # a prefill step does not move it


def test_lead_grows_on_late_calls_and_decays_when_on_time() -> None:
    pacer = StepPacer()
    pacer.observe(timed(0.020), decode_only=True, paced=False)
    pacer.observe(timed(0.020, idle_s=0.002), decode_only=True, paced=True)
    assert pacer.lead_s == pytest.approx(INITIAL_LEAD_S + 0.002)
    pacer.observe(timed(0.020, idle_s=0.0002), decode_only=True, paced=True)
    assert pacer.lead_s == pytest.approx((INITIAL_LEAD_S + 0.002) * LEAD_DECAY)
    pacer.observe(timed(0.020, idle_s=0.5), decode_only=True, paced=True)
    assert pacer.lead_s == pytest.approx(0.020)  # capped at a step: no hold at all
    assert pacer.delay(0.0) == 0.0
    for _ in range(500):
        pacer.observe(timed(0.020), decode_only=True, paced=True)
    assert pacer.lead_s == MIN_LEAD_S
    # Idle time before an unpaced step (an idle engine, a first step) is not the pacer's doing.
    pacer.observe(timed(0.020, idle_s=3.0), decode_only=True, paced=False)
    assert pacer.lead_s == MIN_LEAD_S


class TimedExecutor(Executor):
    """Every scheduled request samples token 7 (prompts fit one step); each
    step reports `busy_s` and records the SchedulerOutputs it was given."""

    def __init__(self, config: EngineConfig, busy_s: float, idle_s: float = 0.0) -> None:
        super().__init__(config)
        self.busy_s = busy_s
        self.idle_s = idle_s
        self.steps: list[SchedulerOutput] = []

    def initialize(self) -> int:
        return 128  # blocks of 4 tokens: more than one max_model_len=256 sequence needs

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [7] * len(ids), None, {}, busy_s=self.busy_s, idle_s=self.idle_s)


def make_core(busy_s: float, *, async_scheduling: bool = True, pace_steps: bool = True, max_num_seqs: int = 4,
              idle_s: float = 0.0) -> tuple[EngineCore, TimedExecutor]:
    config = EngineConfig(
        model_config=ModelConfig(
            model="fake", tokenizer="fake", dtype=torch.float32, max_model_len=256, seed=0, hf_config={}
        ),
        cache_config=CacheConfig(block_size=4, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=256,
            async_scheduling=async_scheduling, pace_steps=pace_steps,
        ),
        parallel_config=ParallelConfig(),
    )
    executor = TimedExecutor(config, busy_s, idle_s)
    return EngineCore(config, executors=[executor]), executor


def add(core: EngineCore, rid: str, max_tokens: int = 20) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(
        EngineCoreRequest(request_id=rid, prompt_token_ids=[11, 12, 13], sampling_params=params, eos_token_id=None)
    )


def test_core_asks_for_a_hold_while_a_step_runs_and_there_is_room() -> None:
    core, executor = make_core(busy_s=10.0)
    assert core.next_step_delay() == 0.0  # nothing running
    add(core, "a")
    core.step()  # a prefill step: no estimate yet
    assert core.next_step_delay() == 0.0
    core.step()  # the first decode-only step sets the estimate (10 s)
    delay = core.next_step_delay()
    # The worker started the queued step moments ago: nearly the whole estimate is left.
    assert 9.0 < delay <= 10.0 - INITIAL_LEAD_S
    add(core, "b")
    core.step()  # the held call: "b" joins the step it schedules
    assert "b" in executor.steps[-1].num_scheduled_tokens


def test_core_does_not_hold_when_requests_wait_or_the_batch_is_full() -> None:
    core, _ = make_core(busy_s=10.0, max_num_seqs=2)
    add(core, "a")
    core.step()
    core.step()
    assert core.next_step_delay() > 0.0
    add(core, "b")
    add(core, "c")  # one more than max_num_seqs: "c" waits
    core.step()
    assert len(core.scheduler.running) == 2 and len(core.scheduler.waiting) == 1
    assert core.next_step_delay() == 0.0


@pytest.mark.parametrize("kw", [dict(pace_steps=False), dict(async_scheduling=False)], ids=["off", "sync"])
def test_core_never_holds_without_pacing(kw: dict) -> None:
    core, _ = make_core(busy_s=10.0, **kw)
    add(core, "a")
    for _ in range(4):
        core.step()
        assert core.next_step_delay() == 0.0


def test_core_marks_the_held_step_as_paced() -> None:
    """A late held call (the worker reports idle time before its step)
    raises the lead; idle time before steps sent at once does not."""
    core, _ = make_core(busy_s=10.0, idle_s=0.004)
    assert core.pacers is not None
    pacer = core.pacers[0]
    add(core, "a")
    core.step()
    core.step()
    assert pacer.lead_s == INITIAL_LEAD_S  # no call was held yet
    assert core.next_step_delay() > 0.0
    core.step()  # schedules the paced step; takes back the one before it
    assert pacer.lead_s == INITIAL_LEAD_S
    core.step()  # takes back the paced step
    assert pacer.lead_s == pytest.approx(INITIAL_LEAD_S + 0.004)
