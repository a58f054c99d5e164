"""Prometheus metrics of one engine, with vLLM's names under a `rayvllm:` prefix.

`EngineMetrics` owns a private `CollectorRegistry`, so any number of engines
(or tests) in one process keep separate state and nothing registers into
prometheus_client's global default registry. Every metric carries a
`model_name` label; `rayvllm:request_success_total` also carries
`finished_reason` (stop | length | abort).

Three feeds update it, each from the engine side that knows the numbers:

- `record_finished(output)`: once per finished request, with its final
  `RequestOutput`: per-request histograms (TTFT, TPOT, e2e latency, queue
  time, prompt and generation lengths) and the success counter.
- `record_tokens(num_prompt, num_generation)`: once per engine step: token
  throughput counters.
- `record_scheduler_stats(stats)`: whenever the engine reads
  `SchedulerStats`: the gauges, and the preemption, prefix-cache,
  speculative-decoding (only with `num_speculative_tokens`) and
  second-KV-tier (`rayvllm:kv_offload_*`, labelled by `tier`) counters.

`render()` gives the text exposition for a `/metrics` endpoint.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    # Types only: the engine imports this module, and the scheduler module
    # imports engine code, so a runtime import could close a cycle.
    from rayvllm.messages.engine_types import SchedulerStats, SpecDecodingStats
    from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput

__all__ = [
    "FINISH_REASONS",
    "LATENCY_BUCKETS_S",
    "TPOT_BUCKETS_S",
    "EngineMetrics",
    "token_count_buckets",
]

# Request-level latencies (TTFT, e2e, queue time): 1 ms .. 10 min, denser
# below a second where interactive serving lives. Anything longer lands in
# +Inf, which histogram_quantile reports as the top finite bound.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0,
)  # fmt: skip

# Time per output token is a decode step: milliseconds on a GPU, tens to
# hundreds of milliseconds on CPU, so the resolution sits there.
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip

# The finish reasons a `CompletionOutput` can end with; the label's values
# are limited to these so the series count stays bounded.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

# The second KV tier's kinds (KVOffloadConfig.tier_name), the `tier` label's values.
KV_OFFLOAD_TIERS: tuple[str, ...] = ("host", "ray")

# KVOffloadStats field -> (metric name, help); all are counters.
_KV_OFFLOAD_COUNTERS: dict[str, tuple[str, str]] = {
    "queries": ("rayvllm:kv_offload_queries", "Prompt tokens looked up in the second KV tier past the pool's hits."),
    "hits": ("rayvllm:kv_offload_hits", "Prompt tokens copied in from the second KV tier (prefix hits by tier)."),
    "stores": ("rayvllm:kv_offload_stores", "KV blocks stored in the second tier on eviction from the pool."),
    "evictions": ("rayvllm:kv_offload_evictions", "KV blocks the second tier evicted to stay in its size."),
    "load_failures": ("rayvllm:kv_offload_load_failures", "KV blocks that failed to load (recomputed instead)."),
    "bytes_stored": ("rayvllm:kv_offload_stored_bytes", "Bytes of KV stored in the second tier."),
    "bytes_loaded": ("rayvllm:kv_offload_loaded_bytes", "Bytes of KV loaded from the second tier."),
}

_DEFAULT_MAX_MODEL_LEN = 131072


def token_count_buckets(max_tokens: int) -> tuple[float, ...]:
    """Buckets 1, 2, 5, 10, 20, 50, ... up to the first one >= `max_tokens`.

    Invariant: strictly increasing, starts at 1, and the last bucket is the
    only one >= `max_tokens`, so no token count a request can have falls in
    +Inf alone (vLLM builds its length buckets the same way).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            buckets.append(float(mantissa * scale))
            if buckets[-1] >= max_tokens:
                return tuple(buckets)
        scale *= 10


class EngineMetrics:
    """The Prometheus metrics of one engine serving `model_name`.

    Invariants:
    - All state lives in this instance's private registry; two instances
      never share a sample, even with the same `model_name`.
    - Every metric is exposed from construction on (labelled children are
      created up front, including one success series per finish reason), so
      dashboards and alerts see zeros rather than missing series.
    - Counters only go up: `record_scheduler_stats` converts the scheduler's
      cumulative preemption count into increments and survives its reset.
    """

    def __init__(
        self, model_name: str, *, max_model_len: int = _DEFAULT_MAX_MODEL_LEN, num_speculative_tokens: int = 0
    ) -> None:
        """`max_model_len` only sizes the prompt/generation length buckets;
        `num_speculative_tokens` > 0 (speculative decoding on) adds the
        `spec_decode_*` counters, one acceptance series per draft position."""
        if not model_name:
            raise ValueError("model_name must be a non-empty string")
        self.model_name = model_name
        self._registry = CollectorRegistry()
        # Guards `_last_num_preemptions`: the read-compare-store must not
        # interleave if two threads report stats (prometheus_client's own
        # metric updates are already thread-safe).
        self._lock = threading.Lock()
        self._last_num_preemptions = 0
        self._last_num_rank_rebuilds = 0
        self._last_spec: SpecDecodingStats | None = None

        labels = ("model_name",)
        reg = self._registry
        length_buckets = token_count_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(model_name)

        self._ttft = histogram(
            "rayvllm:time_to_first_token_seconds",
            "Time from arrival to the first generated token, per request.",
            LATENCY_BUCKETS_S,
        )
        self._tpot = histogram(
            "rayvllm:time_per_output_token_seconds",
            "Mean time between generated tokens of a request, one observation per request.",
            TPOT_BUCKETS_S,
        )
        self._e2e = histogram(
            "rayvllm:e2e_request_latency_seconds",
            "Time from arrival to finish, per request.",
            LATENCY_BUCKETS_S,
        )
        self._queue = histogram(
            "rayvllm:request_queue_time_seconds",
            "Time from arrival to first being scheduled, per request.",
            LATENCY_BUCKETS_S,
        )
        self._prompt_len = histogram(
            "rayvllm:request_prompt_tokens",
            "Prompt length of each finished request, in tokens.",
            length_buckets,
        )
        self._generation_len = histogram(
            "rayvllm:request_generation_tokens",
            "Generated tokens of each finished request.",
            length_buckets,
        )

        self._running = gauge("rayvllm:num_requests_running", "Requests running in the engine.")
        self._waiting = gauge("rayvllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge(
            "rayvllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)."
        )

        # prometheus_client appends `_total` to counter names itself.
        self._prompt_tokens = counter("rayvllm:prompt_tokens", "Prompt tokens processed.")
        self._generation_tokens = counter("rayvllm:generation_tokens", "Tokens generated.")
        self._prefix_queries = counter(
            "rayvllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "rayvllm:prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self._preemptions = counter("rayvllm:num_preemptions", "Requests preempted.")
        self._restarts = counter(
            "rayvllm:engine_restarts", "Engine cores replaced after a failure, their requests resumed."
        )
        self._rank_rebuilds = counter(
            "rayvllm:dp_rank_rebuilds", "Data-parallel worker groups rebuilt after a failure while the others served."
        )
        success = Counter(
            "rayvllm:request_success",
            "Finished requests, by finish reason.",
            ("model_name", "finished_reason"),
            registry=reg,
        )
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._spec_counters: list[Counter] = []
        self._spec_per_pos: list[Counter] = []
        if num_speculative_tokens > 0:
            self._spec_counters = [
                counter("rayvllm:spec_decode_num_drafts", "Verification steps of requests with drafts."),
                counter("rayvllm:spec_decode_num_draft_tokens", "Draft tokens verified."),
                counter("rayvllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            ]
            per_pos = Counter(
                "rayvllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft (0 = first).",
                ("model_name", "position"),
                registry=reg,
            )
            self._spec_per_pos = [per_pos.labels(model_name, str(i)) for i in range(num_speculative_tokens)]
        self._kv_offload: dict[str, dict[str, Counter]] = {tier: {} for tier in KV_OFFLOAD_TIERS}
        for field_name, (name, doc) in _KV_OFFLOAD_COUNTERS.items():
            metric = Counter(name, doc, ("model_name", "tier"), registry=reg)
            for tier in KV_OFFLOAD_TIERS:
                self._kv_offload[tier][field_name] = metric.labels(model_name, tier)

    # ------------------------------------------------------------ per request

    def record_finished(self, output: RequestOutput) -> None:
        """Record one finished request from its final `RequestOutput`.

        Call exactly once per request. Counts one success labelled with
        `outputs[0].finish_reason` (a request with n > 1 sequences is still
        one request). Prompt length is `len(prompt_token_ids)`.

        From `output.metrics` (`time.time()` seconds), each skipped when a
        timestamp it needs is None:
        - TTFT = first_token_time - arrival_time;
        - e2e latency = finished_time - arrival_time;
        - queue time = first_scheduled_time - arrival_time;
        - generation length = num_generation_tokens;
        - TPOT = (last_token_time - first_token_time) / (num_generation_tokens - 1),
          observed ONCE per request (the request's mean inter-token time, as
          `vllm bench serve` defines TPOT), and only with >= 2 tokens. Its
          `_sum / _count` is thus the mean over requests, not over tokens.
        Without `metrics`, only the success counter and the prompt length are
        recorded.

        Raises ValueError for an output that is not finished, has no
        sequences, or ends with a reason outside `FINISH_REASONS`; these
        break `RequestOutput`'s invariants, so the caller has a bug.
        """
        if not output.finished:
            raise ValueError(f"request {output.request_id!r}: output is not finished")
        if not output.outputs:
            raise ValueError(f"request {output.request_id!r}: output has no sequences")
        reason = output.outputs[0].finish_reason
        success = self._success.get(reason) if reason is not None else None
        if success is None:
            raise ValueError(
                f"request {output.request_id!r}: finish_reason {reason!r} is not one of {FINISH_REASONS}"
            )

        success.inc()
        self._prompt_len.observe(len(output.prompt_token_ids))
        m = output.metrics
        if m is None:
            return
        self._generation_len.observe(m.num_generation_tokens)
        if m.first_token_time is not None:
            self._ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self._e2e.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self._queue.observe(m.first_scheduled_time - m.arrival_time)
        if (
            m.num_generation_tokens >= 2
            and m.first_token_time is not None
            and m.last_token_time is not None
        ):
            intervals = m.num_generation_tokens - 1
            self._tpot.observe((m.last_token_time - m.first_token_time) / intervals)

    def record_pooled(self, output: PoolingRequestOutput) -> None:
        """Record one finished pooling request: a success labelled "stop"
        (its vector is its whole answer) and its prompt length; it has no
        generated tokens to time."""
        self._success["stop"].inc()
        self._prompt_len.observe(len(output.prompt_token_ids))

    # ------------------------------------------------------------- per step

    def record_restart(self) -> None:
        """One failed engine core replaced by a new one."""
        self._restarts.inc()

    def record_tokens(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Add one engine step's prompt tokens computed and tokens generated.

        Raises ValueError on a negative count (a counter cannot go down).
        """
        if num_prompt_tokens < 0 or num_generation_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got {num_prompt_tokens}, {num_generation_tokens}"
            )
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc(num_generation_tokens)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Set the gauges from `stats` and advance the scheduler counters.

        What the scheduler reports (rayvllm/core, read at the time of
        writing; `SchedulerStats.combine` sums both over DP ranks):
        - `num_preemptions` is CUMULATIVE: `Scheduler.num_preemptions` only
          ever grows and `make_stats` reports it as is. This adds the
          difference from the previous call. A smaller value than last time
          means the scheduler was rebuilt (e.g. after a failure) and counts
          from 0 again, so the whole new value is the increase (Prometheus's
          own counter-reset rule). A rebuilt DP rank's scheduler carries its
          predecessor's count on.
        - `num_rank_rebuilds` is CUMULATIVE in the same way (an engine
          restart starts it from 0 again).
        - `spec_decoding_stats` is CUMULATIVE in the same way, field by
          field (a restarted engine or rebuilt DP rank counts from 0).
        - `prefix_cache_stats` is PER INTERVAL: `make_prefix_cache_stats`
          hands out the counts since its previous call and restarts them
          at 0, so `queries` and `hits` (tokens) are added as they are.
          Consequently every `make_stats()` result must reach this method
          exactly once, or that interval's lookups are lost or doubled.
        """
        self._running.set(stats.num_running_reqs)
        self._waiting.set(stats.num_waiting_reqs)
        self._kv_usage.set(stats.kv_cache_usage)

        prefix = stats.prefix_cache_stats
        self._prefix_queries.inc(prefix.queries)
        self._prefix_hits.inc(prefix.hits)
        offload = stats.kv_offload_stats
        if offload is not None and offload.tier in self._kv_offload:
            # Per interval, like the prefix-cache counts.
            for field_name, child in self._kv_offload[offload.tier].items():
                child.inc(getattr(offload, field_name))

        with self._lock:
            current = stats.num_preemptions
            last = self._last_num_preemptions
            increase = current - last if current >= last else current
            self._last_num_preemptions = current
            rebuilds = stats.num_rank_rebuilds
            rebuilt = rebuilds - self._last_num_rank_rebuilds if rebuilds >= self._last_num_rank_rebuilds else rebuilds
            self._last_num_rank_rebuilds = rebuilds
            spec = stats.spec_decoding_stats
            spec_increase = None
            if spec is not None and self._spec_counters:
                spec_increase = _spec_increase(spec, self._last_spec)
                self._last_spec = spec
        self._preemptions.inc(increase)
        self._rank_rebuilds.inc(rebuilt)
        if spec_increase is not None:
            totals, per_pos = spec_increase
            for metric, n in zip(self._spec_counters, totals):
                metric.inc(n)
            for metric, n in zip(self._spec_per_pos, per_pos):
                metric.inc(n)

    # --------------------------------------------------------------- export

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this instance's metrics, and
        the HTTP Content-Type to send it with."""
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    def families(self) -> list[Metric]:
        """This instance's metric families as they stand (for an exporter
        other than `/metrics`, e.g. Ray's: actors/ray_metrics.py)."""
        return list(self._registry.collect())


def _spec_increase(
    current: SpecDecodingStats, last: SpecDecodingStats | None
) -> tuple[list[int], list[int]]:
    """Increases of the cumulative counts since `last` (totals: drafts, draft
    tokens, accepted tokens; then per position); a drop means a reset."""
    now = [current.num_drafts, current.num_draft_tokens, current.num_accepted_tokens]
    before = [0, 0, 0] if last is None else [last.num_drafts, last.num_draft_tokens, last.num_accepted_tokens]
    before_pos = [0] * len(current.num_accepted_tokens_per_pos) if last is None else last.num_accepted_tokens_per_pos
    if any(n < b for n, b in zip(now, before)):
        before, before_pos = [0, 0, 0], [0] * len(current.num_accepted_tokens_per_pos)
    return (
        [n - b for n, b in zip(now, before)],
        [n - b for n, b in zip(current.num_accepted_tokens_per_pos, before_pos)],
    )
