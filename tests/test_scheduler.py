"""Scheduler: token budget, chunked prefill, preemption, abort, priority,
prefix hits and n > 1 siblings, driven with synthetic model outputs."""

from __future__ import annotations

from rayvllm.config import CacheConfig, SchedulerConfig
from rayvllm.core.request import Request
from rayvllm.core.sched.scheduler import Scheduler
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.request import EngineCoreRequest, FinishReason, RequestStatus
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.scheduler_output import SchedulerOutput


def make_scheduler(
    num_blocks: int = 100,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=256,
            policy=policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching, num_blocks=num_blocks),
    )


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float = 0.0,
    parent: str | None = None,
    stop_ids: tuple[int, ...] = (),
    final_only: bool = False,
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=list(stop_ids))
    return Request(
        EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            eos_token_id=None,
            arrival_time=arrival,
            priority=priority,
            parent_request_id=parent,
            final_only=final_only,
        )
    )


def fake_run(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Samples `token` for every request whose scheduled tokens reach its end."""
    ids = [
        rid for rid, n in so.num_scheduled_tokens.items()
        if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
    ]
    return ModelRunnerOutput(ids, [token] * len(ids), None, {})


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    return so, sched.update_from_output(so, fake_run(so, sched, token))


def test_budget_and_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", list(range(100, 125))))  # 25 tokens
    sched.add_request(make_request("b", list(range(200, 204))))
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]
    assert so.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    assert outs == []  # mid-prefill: nothing sampled
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [10]
    assert so.scheduled_cached_reqs.new_block_ids == [[4, 5]]
    so, outs = step(sched)
    # a's last 5 prompt tokens, then b's 4 prompt tokens fit in the same budget
    assert so.num_scheduled_tokens == {"a": 5, "b": 4}
    assert so.total_num_scheduled_tokens == 9
    assert [o.request_id for o in outs] == ["a", "b"]
    so, outs = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}  # decodes, with only deltas
    assert so.scheduled_new_reqs == []


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), [1, 2, 3]))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"0", "1"}
    assert len(sched.waiting) == 1


def test_length_and_stop_token_finish_free_blocks() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    sched.add_request(make_request("b", [4, 5, 6], max_tokens=5, stop_ids=(9,)))
    _, outs = step(sched)
    assert all(o.finish_reason is None for o in outs)
    so, outs = step(sched, token=9)
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].finish_reason == FinishReason.LENGTH
    assert by_id["b"].finish_reason == FinishReason.STOP and by_id["b"].stop_reason == 9
    assert not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"}
    assert sched.kv_cache_manager.usage == 0.0


def test_a_final_only_request_emits_its_first_token_then_the_rest_at_its_end() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("q", [1, 2, 3], max_tokens=5, stop_ids=(9,), final_only=True))
    sched.add_request(make_request("a", [4, 5, 6], max_tokens=5))
    emitted: dict[str, list[tuple[list[int], FinishReason | None]]] = {"q": [], "a": []}
    for token in (20, 21, 22, 9):
        _, outs = step(sched, token=token)
        for o in outs:
            emitted[o.request_id].append((o.new_token_ids, o.finish_reason))
    assert emitted["a"] == [([20], None), ([21], None), ([22], None), ([9], None)]
    # Ended by its stop token, with every token since its first.
    assert emitted["q"] == [([20], None), ([21, 22, 9], FinishReason.STOP)]


def test_preemption_recomputes_latest_arrival() -> None:
    # 6 usable blocks of 4 tokens. Two 8-token prompts take 2 blocks each;
    # decoding past 12 tokens needs a 3rd and then 4th block each.
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64, caching=False)
    sched.add_request(make_request("old", list(range(10, 18)), max_tokens=10, arrival=1.0))
    sched.add_request(make_request("new", list(range(20, 28)), max_tokens=10, arrival=2.0))
    preempted_seen = False
    for _ in range(12):
        so, _ = step(sched)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"new"}
            assert "new" not in so.num_scheduled_tokens
            preempted_seen = True
            break
    assert preempted_seen
    new = next(r for r in sched.waiting)
    assert new.request_id == "new" and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.num_output_tokens > 0
    while sched.requests.get("old") is not None:
        step(sched)
    # Resumed: full data again (prompt + generated tokens), recomputed from 0.
    so = sched.schedule()
    (resumed,) = so.scheduled_new_reqs
    assert resumed.req_id == "new" and resumed.num_computed_tokens == 0
    assert resumed.output_token_ids == [7] * new.num_output_tokens
    assert so.num_scheduled_tokens["new"] == new.num_tokens


def test_priority_policy_orders_and_preempts_lowest_priority() -> None:
    sched = make_scheduler(num_blocks=7, caching=False, policy="priority", max_num_seqs=2)
    sched.add_request(make_request("low", list(range(10, 18)), max_tokens=10, priority=5, arrival=1.0))
    sched.add_request(make_request("high", list(range(20, 28)), max_tokens=10, priority=0, arrival=2.0))
    sched.add_request(make_request("mid", list(range(30, 38)), max_tokens=10, priority=1, arrival=0.5))
    so, _ = step(sched)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high", "mid"]
    for _ in range(12):
        so, _ = step(sched)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"mid"}
            break
    else:
        raise AssertionError("no preemption")


def test_abort_running_and_waiting() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", [1, 2, 3, 4, 5]))
    sched.add_request(make_request("b", [6, 7, 8]))
    step(sched)
    assert sched.abort_requests(["a", "b", "zzz"]) == ["a", "b"]
    assert not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.is_empty
    assert sched.kv_cache_manager.usage == 0.0


def test_prefix_hit_starts_with_computed_tokens() -> None:
    sched = make_scheduler()
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12
    assert new.block_ids[:3] == [1, 2, 3]  # a's cached blocks, shared
    assert so.num_scheduled_tokens["b"] == 1


def test_n_siblings_share_the_prompt_blocks() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(60, 73))  # 13 tokens, prefilled over two steps
    for i in range(3):
        sched.add_request(make_request(f"{i}_p", prompt, max_tokens=2, parent="p"))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"0_p": 8}  # siblings wait for the leader
    so, _ = step(sched)
    # The leader finishes its prompt; its 3 full blocks are cached at once, so
    # the siblings join in the same step and only compute the last token.
    assert so.num_scheduled_tokens == {"0_p": 5, "1_p": 1, "2_p": 1}
    leader_blocks = sched.kv_cache_manager.get_block_ids("0_p")
    for sib in ("1_p", "2_p"):
        assert sched.kv_cache_manager.get_block_ids(sib)[:3] == leader_blocks[:3]
    assert sched.kv_cache_manager.block_pool.blocks[leader_blocks[0]].ref_cnt == 3


def test_async_scheduling_schedules_against_tokens_in_flight() -> None:
    """Two steps in flight: the second feeds the token the first will sample
    (an output placeholder), a request whose in-flight tokens reach
    max_tokens is not scheduled again, and the token computed past a stop
    id is dropped."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, async_scheduling=True),
        CacheConfig(block_size=4, enable_prefix_caching=False, num_blocks=20),
        max_inflight_steps=2,
    )
    sched.add_request(make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=3))
    sched.add_request(make_request("b", [8, 9, 10, 11], max_tokens=10, stop_ids=(42,)))

    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"a": 6, "b": 4}
    assert [sched.requests[r].num_output_placeholders for r in ("a", "b")] == [1, 1]
    so2 = sched.schedule()  # before so1's tokens are back
    assert so2.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so2.scheduled_cached_reqs.num_computed_tokens == [6, 4]
    # a's 7th slot fits its 2nd block; b's 5th needs a new one.
    assert so2.scheduled_cached_reqs.new_block_ids == [[], [4]]
    assert [sched.requests[r].num_output_placeholders for r in ("a", "b")] == [2, 2]

    outs = sched.update_from_output(so1, ModelRunnerOutput(["a", "b"], [11, 42], None, {}))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [11], None), ("b", [42], FinishReason.STOP)
    ]
    assert sched.requests["a"].num_output_placeholders == 1
    so3 = sched.schedule()
    assert so3.num_scheduled_tokens == {"a": 1}
    assert so3.finished_req_ids == {"b"}
    outs = sched.update_from_output(so2, ModelRunnerOutput(["a", "b"], [12, 99], None, {}))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [12])]  # b's extra token dropped
    # a's third and last token is in flight (so3): nothing more to schedule for it.
    so4 = sched.schedule()
    assert so4.num_scheduled_tokens == {}
    outs = sched.update_from_output(so3, ModelRunnerOutput(["a"], [13], None, {}))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("a", [13], FinishReason.LENGTH)]
    assert sched.requests == {} and sched.kv_cache_manager.usage == 0.0


def test_a_reused_id_never_takes_the_results_of_steps_in_flight_for_its_predecessor() -> None:
    """A request aborted while its steps are in flight, and a new request
    added under the same id before they return (a client reusing its
    request id): those steps' tokens belong to the aborted request and are
    dropped; the new one starts from its own prompt (no KV, no tokens)."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, async_scheduling=True),
        CacheConfig(block_size=4, enable_prefix_caching=True, num_blocks=20),
        max_inflight_steps=2,
    )
    sched.add_request(make_request("x", [1, 2, 3, 4, 5, 6], max_tokens=8))
    so1 = sched.schedule()
    so2 = sched.schedule()  # both in flight
    assert so1.num_scheduled_tokens == {"x": 6} and so2.num_scheduled_tokens == {"x": 1}
    assert sched.abort_requests(["x"]) == ["x"]
    sched.add_request(make_request("x", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2))
    assert sched.update_from_output(so1, ModelRunnerOutput(["x"], [11], None, {})) == []
    assert sched.update_from_output(so2, ModelRunnerOutput(["x"], [12], None, {})) == []
    new = sched.requests["x"]
    assert new.num_output_tokens == 0 and new.num_inflight_steps == 0
    so3 = sched.schedule()  # the new request's prefill, over the blocks the old one cached
    assert so3.finished_req_ids == {"x"} and so3.num_scheduled_tokens == {"x": 9 - 4}  # 4: the cached first block
    assert [r.req_id for r in so3.scheduled_new_reqs] == ["x"]
    outs = sched.update_from_output(so3, ModelRunnerOutput(["x"], [21], None, {}))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("x", [21])]


def test_an_id_added_while_live_replaces_the_live_request() -> None:
    """A second add under a live id (its client let the first go without
    the abort reaching the core): the first is aborted, its blocks freed,
    and the new one prefills from the prefix cache as any new request does,
    rather than two requests sharing one id's KV bookkeeping."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4, enable_prefix_caching=True, num_blocks=20),
    )
    sched.add_request(make_request("x", [1, 2, 3, 4, 5, 6], max_tokens=8))
    so1 = sched.schedule()
    sched.update_from_output(so1, fake_run(so1, sched))
    old = sched.requests["x"]
    sched.add_request(make_request("x", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=2))
    assert old.status == RequestStatus.FINISHED_ABORTED and old not in sched.running
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 20 - 1  # all but the null block
    so2 = sched.schedule()
    assert so2.finished_req_ids == {"x"} and so2.num_scheduled_tokens == {"x": 9 - 4}  # 4: the cached first block
    assert [r.req_id for r in so2.scheduled_new_reqs] == ["x"]
