"""The engine's data types, at the bottom of the import graph: what a model
runner returns for a step (`ModelRunnerOutput`, its logprob rows), what the
engine core emits per request (`EngineCoreOutput`), the scheduler's stats
(`SchedulerStats`, `PrefixCacheStats`), and the typed messages between an
engine loop and its client (`AddRequests`, `AbortRequests` in,
`EngineCoreOutputs`, `EngineCoreFailure` out). Every layer above imports
them from here; this module imports nothing of rayvllm but `request`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from rayvllm.messages.request import EngineCoreRequest, FinishReason

if TYPE_CHECKING:
    import torch


@dataclass
class LogprobsTensors:
    """Row i: `logprob_token_ids[i, 0]` is the chosen (sampled or actual) token,
    columns 1.. the top-N tokens; `ranks[i]` is the chosen token's rank (1 = best)."""

    logprob_token_ids: torch.Tensor  # [R, N+1] int64
    logprobs: torch.Tensor  # [R, N+1] float32
    ranks: torch.Tensor  # [R] int64

    def tolists(self) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        )


@dataclass
class LogprobsLists:
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


@dataclass
class SpecDecodeOutput:
    """A step's speculative-decoding results. `token_ids[r]`: what request r,
    which verified drafts this step, emits (the accepted drafts, then the
    target's own next token: 1 to k+1 tokens), with `logprobs[r]` one row
    per token when it asked; such a request is absent from the step's
    `req_ids`. `draft_token_ids[r]`: drafts proposed for r's next step."""

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """Invariant: `sampled_token_ids[i]` belongs to `req_ids[i]`, one token per
    request whose scheduled tokens reached the end of its sequence; requests in
    the middle of a chunked prefill are absent. `logprobs` rows align with
    `req_ids` when any of them asked for logprobs. `prompt_logprobs` holds, per
    request that asked, the rows for the prompt positions computed this step.
    A pooling runner samples nothing: `pooler_output` holds the vector
    (float32 numpy, on the host) of each request whose prompt ended this step."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None
    prompt_logprobs: dict[str, LogprobsLists]
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    spec_decode: SpecDecodeOutput | None = None
    # Blocks whose copy in from the second KV tier failed (kv_offload/).
    kv_load_failures: list[int] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step.

    `finish_reason` is set on the last output of a request; `stop_reason` is
    the stop token id that ended it (a stop *string* is found later, by the
    OutputProcessor, which then asks the core to abort the request).
    `new_prompt_logprobs` carries prompt positions computed this step; the
    first prompt token has none, as in vLLM. A pooling request's one
    output carries its vector in `pooling_output` and no token.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set on a request's first token only: when the scheduler first ran it.
    first_scheduled_time: float | None = None
    pooling_output: np.ndarray | None = None

    def __reduce__(self) -> tuple[type["EngineCoreOutput"], tuple[object, ...]]:
        # A step's outputs cross a process boundary on the Ray path; default
        # pickling (class + field dict per object) cost ~0.5 ms for 64
        # decodes, positional args with the default tail cut off ~0.2 ms.
        args = (
            self.request_id,
            self.new_token_ids,
            self.new_logprobs,
            self.new_prompt_logprobs,
            self.finish_reason,
            self.stop_reason,
            self.num_cached_tokens,
            self.first_scheduled_time,
            self.pooling_output,
        )
        end = len(args)
        # None defaults by identity: an array compared with == is no bool.
        while end > 2 and (
            args[end - 1] is None if _DEFAULTS[end - 1] is None else args[end - 1] == _DEFAULTS[end - 1]
        ):
            end -= 1
        return (EngineCoreOutput, args[:end])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_DEFAULTS: tuple[object, ...] = (None, None, None, None, None, None, 0, None, None)


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last `reset()`.

    `requests`: lookups performed; `queries`: prompt tokens looked up;
    `hits`: tokens served from the cache. Invariant: `0 <= hits <= queries`.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    def add(self, other: "PrefixCacheStats") -> None:
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits

    def reset(self) -> None:
        self.requests = 0
        self.queries = 0
        self.hits = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of queried tokens that hit; 0.0 when nothing was queried."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SpecDecodingStats:
    """Cumulative speculative-decoding counts of a scheduler (vLLM's
    names): requests' verification steps (`num_drafts`), drafts verified,
    drafts accepted, and accepted drafts per draft position."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(
            self.num_spec_tokens, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    def add(self, other: "SpecDecodingStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[pos] += n


@dataclass
class KVOffloadStats:
    """Second-KV-tier counters of one interval (core/kv_offload_manager.py).

    `queries`: tokens looked up in the tier past the pool's own hits;
    `hits`: tokens copied in from it (then counted again as prefix-cache
    hits, where the request finds them); `stores`, `evictions`,
    `load_failures`: blocks; `bytes_*`: over the whole worker group."""

    tier: str = ""
    queries: int = 0
    hits: int = 0
    stores: int = 0
    evictions: int = 0
    load_failures: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0

    def add(self, other: "KVOffloadStats") -> None:
        self.tier = self.tier or other.tier
        for f in fields(self):
            if f.name != "tier":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class BlockEvents:
    """The routing keys (`routing_key`) of the blocks an engine core's pools
    began and stopped caching since its previous push, over all its DP
    ranks. `reset`: the first push of a new core, whose pools start empty;
    replaying every push since the last reset reproduces the core's cached
    set exactly."""

    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    reset: bool = False


@dataclass
class SchedulerStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: PrefixCacheStats
    num_preemptions: int
    # DP ranks whose dead worker group the core rebuilt (cumulative).
    num_rank_rebuilds: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None
    kv_offload_stats: KVOffloadStats | None = None
    block_events: BlockEvents | None = None

    @classmethod
    def combine(cls, per_rank: list["SchedulerStats"]) -> "SchedulerStats":
        """Totals over data-parallel ranks; KV usage is the mean (the ranks'
        pools are the same size)."""
        prefix = PrefixCacheStats()
        spec = None
        offload: KVOffloadStats | None = None
        for s in per_rank:
            prefix.add(s.prefix_cache_stats)
            if s.spec_decoding_stats is not None:
                if spec is None:
                    spec = SpecDecodingStats(s.spec_decoding_stats.num_spec_tokens)
                spec.add(s.spec_decoding_stats)
            if s.kv_offload_stats is not None:
                offload = offload or KVOffloadStats()
                offload.add(s.kv_offload_stats)
        return cls(
            num_running_reqs=sum(s.num_running_reqs for s in per_rank),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in per_rank),
            kv_cache_usage=sum(s.kv_cache_usage for s in per_rank) / len(per_rank),
            prefix_cache_stats=prefix,
            num_preemptions=sum(s.num_preemptions for s in per_rank),
            spec_decoding_stats=spec,
            kv_offload_stats=offload,
        )


# ---- the engine loop's channel (core_loop.py <-> ray_core_client.py) -----------------


@dataclass
class AddRequests:
    """Requests that share one prompt (the children of an n > 1 request),
    added together so that they land on one DP rank."""

    requests: list[EngineCoreRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]


EngineCoreInput = AddRequests | AbortRequests


@dataclass
class EngineCoreOutputs:
    """One push from an engine loop: the outputs of its latest step (the
    steps since the previous push had none: those may push nothing), the
    scheduler stats right after it, and how many inputs the
    loop has applied in all (so the client knows which of its sends are
    done). `scheduler_stats.prefix_cache_stats` counts since the previous
    push."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    inputs_applied: int


@dataclass
class EngineCoreFailure:
    """The last push of a loop that stopped on an error; `culprits` as in
    `StepFailedError` (empty when the cause is not a step's)."""

    error: str
    culprits: list[str] = field(default_factory=list)
