"""EngineMetrics: exact sample values read back from its text exposition."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayvllm.frontend.metrics import (
    FINISH_REASONS,
    LATENCY_BUCKETS_S,
    TPOT_BUCKETS_S,
    EngineMetrics,
    token_count_buckets,
)
from rayvllm.messages.engine_types import PrefixCacheStats, SchedulerStats
from rayvllm.messages.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "tiny-llama"
# Timestamps are sums of powers of two so every difference is exact in floats.
T0 = 1_700_000_000.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: EngineMetrics) -> Samples:
    """Every sample of `render()`, keyed by (sample name, label set)."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(all_samples: Samples, name: str, **labels: str) -> float:
    return all_samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def bucket(all_samples: Samples, name: str, le: float) -> float:
    """Cumulative count of the bucket with upper bound `le` (math.inf = +Inf)."""
    key = "+Inf" if le == math.inf else repr(float(le))
    return value(all_samples, f"{name}_bucket", le=key)


def finished_output(
    request_id: str,
    *,
    prompt_len: int,
    finish_reason: str,
    metrics: RequestMetrics | None,
    n: int = 1,
) -> RequestOutput:
    outputs = [
        CompletionOutput(
            index=i, text="", token_ids=[7], cumulative_logprob=None, logprobs=None,
            finish_reason=finish_reason if i == 0 else "length",
        )
        for i in range(n)
    ]  # fmt: skip
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        prompt_logprobs=None,
        outputs=outputs,
        finished=True,
        metrics=metrics,
    )


def scheduler_stats(
    *, running: int = 0, waiting: int = 0, usage: float = 0.0,
    queries: int = 0, hits: int = 0, preemptions: int = 0,
) -> SchedulerStats:  # fmt: skip
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=usage,
        prefix_cache_stats=PrefixCacheStats(requests=1 if queries else 0, queries=queries, hits=hits),
        num_preemptions=preemptions,
    )


def test_fresh_instance_exposes_every_metric_at_zero() -> None:
    s = samples(EngineMetrics(MODEL))
    for name in (
        "rayvllm:time_to_first_token_seconds",
        "rayvllm:time_per_output_token_seconds",
        "rayvllm:e2e_request_latency_seconds",
        "rayvllm:request_queue_time_seconds",
        "rayvllm:request_prompt_tokens",
        "rayvllm:request_generation_tokens",
    ):
        assert value(s, f"{name}_count") == 0
        assert value(s, f"{name}_sum") == 0
        assert bucket(s, name, math.inf) == 0
    for name in (
        "rayvllm:num_requests_running",
        "rayvllm:num_requests_waiting",
        "rayvllm:kv_cache_usage_perc",
        "rayvllm:prompt_tokens_total",
        "rayvllm:generation_tokens_total",
        "rayvllm:prefix_cache_queries_total",
        "rayvllm:prefix_cache_hits_total",
        "rayvllm:num_preemptions_total",
    ):
        assert value(s, name) == 0
    for reason in FINISH_REASONS:
        assert value(s, "rayvllm:request_success_total", finished_reason=reason) == 0
    # Histogram buckets are exactly the documented ones (plus +Inf).
    ttft_les = sorted(
        float(dict(labels)["le"]) for (name, labels) in s if name == "rayvllm:time_to_first_token_seconds_bucket"
    )
    assert ttft_les == [*LATENCY_BUCKETS_S, math.inf]
    tpot_les = sorted(
        float(dict(labels)["le"]) for (name, labels) in s if name == "rayvllm:time_per_output_token_seconds_bucket"
    )
    assert tpot_les == [*TPOT_BUCKETS_S, math.inf]


def test_record_finished_histograms_and_success() -> None:
    m = EngineMetrics(MODEL, max_model_len=1000)
    # Request a: queued 0.25 s, TTFT 0.5 s, 5 tokens 1 s apart in all -> TPOT 0.25 s, e2e 1.5 s.
    a = RequestMetrics(
        arrival_time=T0,
        first_scheduled_time=T0 + 0.25,
        first_token_time=T0 + 0.5,
        last_token_time=T0 + 1.5,
        finished_time=T0 + 1.5,
        num_generation_tokens=5,
    )
    # Request b: never scheduled stamp, one token (no TPOT), finished by length, n=2.
    b = RequestMetrics(
        arrival_time=T0,
        first_scheduled_time=None,
        first_token_time=T0 + 0.0078125,
        last_token_time=T0 + 0.0078125,
        finished_time=T0 + 0.0078125,
        num_generation_tokens=1,
    )
    # Request c: aborted before any token: only e2e, queue and lengths.
    c = RequestMetrics(arrival_time=T0, first_scheduled_time=T0 + 0.03125, finished_time=T0 + 700.0)
    m.record_finished(finished_output("a", prompt_len=3, finish_reason="stop", metrics=a))
    m.record_finished(finished_output("b", prompt_len=40, finish_reason="length", metrics=b, n=2))
    m.record_finished(finished_output("c", prompt_len=1, finish_reason="abort", metrics=c))
    s = samples(m)

    ttft = "rayvllm:time_to_first_token_seconds"
    assert value(s, f"{ttft}_count") == 2
    assert value(s, f"{ttft}_sum") == 0.5 + 0.0078125
    assert bucket(s, ttft, 0.005) == 0
    assert bucket(s, ttft, 0.01) == 1
    assert bucket(s, ttft, 0.25) == 1
    assert bucket(s, ttft, 0.5) == 2  # le is inclusive
    assert bucket(s, ttft, math.inf) == 2

    tpot = "rayvllm:time_per_output_token_seconds"
    assert value(s, f"{tpot}_count") == 1  # once per request, only a has >= 2 tokens
    assert value(s, f"{tpot}_sum") == 0.25
    assert bucket(s, tpot, 0.2) == 0
    assert bucket(s, tpot, 0.3) == 1

    e2e = "rayvllm:e2e_request_latency_seconds"
    assert value(s, f"{e2e}_count") == 3
    assert value(s, f"{e2e}_sum") == 1.5 + 0.0078125 + 700.0
    assert bucket(s, e2e, 0.01) == 1
    assert bucket(s, e2e, 2.5) == 2
    assert bucket(s, e2e, 600.0) == 2  # 700 s is past the last finite bucket
    assert bucket(s, e2e, math.inf) == 3

    queue = "rayvllm:request_queue_time_seconds"
    assert value(s, f"{queue}_count") == 2  # b has no first_scheduled_time
    assert value(s, f"{queue}_sum") == 0.25 + 0.03125
    assert bucket(s, queue, 0.02) == 0
    assert bucket(s, queue, 0.04) == 1
    assert bucket(s, queue, 0.25) == 2

    prompt = "rayvllm:request_prompt_tokens"
    assert value(s, f"{prompt}_count") == 3
    assert value(s, f"{prompt}_sum") == 3 + 40 + 1
    assert bucket(s, prompt, 1) == 1
    assert bucket(s, prompt, 5) == 2
    assert bucket(s, prompt, 50) == 3
    assert bucket(s, prompt, 1000) == 3

    gen = "rayvllm:request_generation_tokens"
    assert value(s, f"{gen}_count") == 3
    assert value(s, f"{gen}_sum") == 5 + 1 + 0
    assert bucket(s, gen, 1) == 2
    assert bucket(s, gen, 5) == 3

    success = "rayvllm:request_success_total"
    assert value(s, success, finished_reason="stop") == 1
    assert value(s, success, finished_reason="length") == 1  # n=2 still counts once
    assert value(s, success, finished_reason="abort") == 1
    # Per-request recording never touches the step-level counters.
    assert value(s, "rayvllm:prompt_tokens_total") == 0
    assert value(s, "rayvllm:generation_tokens_total") == 0


def test_record_finished_without_metrics_counts_success_and_prompt_only() -> None:
    m = EngineMetrics(MODEL)
    m.record_finished(finished_output("x", prompt_len=7, finish_reason="stop", metrics=None))
    s = samples(m)
    assert value(s, "rayvllm:request_success_total", finished_reason="stop") == 1
    assert value(s, "rayvllm:request_prompt_tokens_count") == 1
    assert value(s, "rayvllm:request_prompt_tokens_sum") == 7
    assert value(s, "rayvllm:request_generation_tokens_count") == 0
    assert value(s, "rayvllm:e2e_request_latency_seconds_count") == 0


def test_record_finished_rejects_outputs_that_break_invariants() -> None:
    m = EngineMetrics(MODEL)
    unfinished = finished_output("u", prompt_len=1, finish_reason="stop", metrics=None)
    unfinished.finished = False
    with pytest.raises(ValueError, match="not finished"):
        m.record_finished(unfinished)
    with pytest.raises(ValueError, match="finish_reason"):
        m.record_finished(finished_output("w", prompt_len=1, finish_reason="weird", metrics=None))
    empty = finished_output("e", prompt_len=1, finish_reason="stop", metrics=None)
    empty.outputs = []
    with pytest.raises(ValueError, match="no sequences"):
        m.record_finished(empty)
    s = samples(m)
    assert all(value(s, "rayvllm:request_success_total", finished_reason=r) == 0 for r in FINISH_REASONS)


def test_record_tokens_accumulates() -> None:
    m = EngineMetrics(MODEL)
    m.record_tokens(128, 0)
    m.record_tokens(16, 4)
    m.record_tokens(0, 4)
    s = samples(m)
    assert value(s, "rayvllm:prompt_tokens_total") == 144
    assert value(s, "rayvllm:generation_tokens_total") == 8
    with pytest.raises(ValueError):
        m.record_tokens(-1, 0)


def test_record_scheduler_stats_gauges_and_counters() -> None:
    m = EngineMetrics(MODEL)
    # num_preemptions is cumulative in the scheduler; prefix stats are per interval.
    m.record_scheduler_stats(scheduler_stats(running=3, waiting=2, usage=0.5, queries=64, hits=32, preemptions=2))
    m.record_scheduler_stats(scheduler_stats(running=1, waiting=0, usage=0.25, queries=16, hits=0, preemptions=5))
    s = samples(m)
    assert value(s, "rayvllm:num_requests_running") == 1
    assert value(s, "rayvllm:num_requests_waiting") == 0
    assert value(s, "rayvllm:kv_cache_usage_perc") == 0.25
    assert value(s, "rayvllm:prefix_cache_queries_total") == 80
    assert value(s, "rayvllm:prefix_cache_hits_total") == 32
    assert value(s, "rayvllm:num_preemptions_total") == 5

    # Same cumulative count again: no new preemptions.
    m.record_scheduler_stats(scheduler_stats(preemptions=5))
    assert value(samples(m), "rayvllm:num_preemptions_total") == 5
    # A rebuilt scheduler counts from 0 again: 1 is one new preemption, not -4.
    m.record_scheduler_stats(scheduler_stats(preemptions=1))
    assert value(samples(m), "rayvllm:num_preemptions_total") == 6
    m.record_scheduler_stats(scheduler_stats(preemptions=3))
    assert value(samples(m), "rayvllm:num_preemptions_total") == 8


def test_scheduler_stats_from_a_real_scheduler_are_read_as_documented() -> None:
    """Pin the cumulative / per-interval behaviour the metrics rely on."""
    from rayvllm.config import CacheConfig, SchedulerConfig
    from rayvllm.core.sched.scheduler import Scheduler

    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=16),
    )
    sched.num_preemptions = 3
    sched.kv_cache_manager.prefix_cache_stats.queries = 10
    first = sched.make_stats()
    second = sched.make_stats()
    assert (first.num_preemptions, second.num_preemptions) == (3, 3)  # cumulative
    assert (first.prefix_cache_stats.queries, second.prefix_cache_stats.queries) == (10, 0)  # reset on read

    m = EngineMetrics(MODEL)
    m.record_scheduler_stats(first)
    m.record_scheduler_stats(second)
    s = samples(m)
    assert value(s, "rayvllm:num_preemptions_total") == 3
    assert value(s, "rayvllm:prefix_cache_queries_total") == 10


def test_instances_do_not_share_state() -> None:
    a = EngineMetrics(MODEL)
    b = EngineMetrics(MODEL)  # same name: still a separate registry
    c = EngineMetrics("other-model")
    a.record_tokens(10, 1)
    a.record_scheduler_stats(scheduler_stats(running=7, preemptions=4))
    a.record_finished(finished_output("a", prompt_len=2, finish_reason="stop", metrics=RequestMetrics(T0)))
    sa, sb = samples(a), samples(b)
    assert value(sa, "rayvllm:prompt_tokens_total") == 10
    assert value(sb, "rayvllm:prompt_tokens_total") == 0
    assert value(sb, "rayvllm:num_requests_running") == 0
    assert value(sb, "rayvllm:num_preemptions_total") == 0
    assert value(sb, "rayvllm:request_success_total", finished_reason="stop") == 0
    # b's preemption baseline is its own: its first report counts in full.
    b.record_scheduler_stats(scheduler_stats(preemptions=4))
    assert value(samples(b), "rayvllm:num_preemptions_total") == 4
    # Every sample carries its own instance's model_name label.
    body, _ = c.render()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            assert s.labels["model_name"] == "other-model"


def test_token_count_buckets() -> None:
    assert token_count_buckets(1) == (1.0,)
    assert token_count_buckets(3) == (1.0, 2.0, 5.0)
    assert token_count_buckets(1000) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
    assert token_count_buckets(4096)[-2:] == (2000.0, 5000.0)
    with pytest.raises(ValueError):
        token_count_buckets(0)
    with pytest.raises(ValueError):
        EngineMetrics("")
