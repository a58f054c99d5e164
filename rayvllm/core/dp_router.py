"""Pick the data-parallel rank for a new request: longest exact prefix hit
first, then least load, then lowest rank.

Prefix first because a hit saves real prefill compute and KV memory on that
rank, while load differences are transient; load second so that requests with
nothing cached (the common case) spread evenly. The lowest-rank rule only
makes the choice deterministic.

Ray-free: the caller (the scheduler actor) measures each rank's `RankLoad`
and owns the `PrefixIndex` fed by the ranks' block pools.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rayvllm.core.prefix_index import PrefixIndex
from rayvllm.core.request import Request
from rayvllm.messages.block_hash import BlockHash, hit_block_hashes, request_extra_keys


@dataclass(frozen=True, slots=True)
class RankLoad:
    """How busy one DP rank is, as the router compares it.

    ``num_queued_tokens``: tokens the rank still has to prefill before its
    queued work reaches decode, i.e. the sum of
    ``num_tokens - num_computed_tokens`` over its waiting (including
    preempted) requests plus ``max(0, num_prompt_tokens - num_computed_tokens)``
    over its running requests (a decoding request counts 0).
    ``kv_usage``: fraction of the rank's usable KV blocks owned by requests
    (`KVCacheManager.usage`), in ``[0, 1]``.

    Loads order lexicographically by ``(num_queued_tokens, kv_usage)``:
    queued prefill is the work a new request waits behind; KV usage separates
    ranks with equally short queues (e.g. both idle except for decodes).
    """

    num_queued_tokens: int
    kv_usage: float

    def __post_init__(self) -> None:
        if self.num_queued_tokens < 0:
            raise ValueError(f"num_queued_tokens must be >= 0, got {self.num_queued_tokens}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")

    @property
    def sort_key(self) -> tuple[int, float]:
        """Smaller is less loaded."""
        return (self.num_queued_tokens, self.kv_usage)

    @classmethod
    def from_requests(
        cls, waiting: Iterable[Request], running: Iterable[Request], kv_usage: float
    ) -> RankLoad:
        """Build a load from a rank's queues, by the definition above."""
        queued = sum(r.num_tokens - r.num_computed_tokens for r in waiting)
        queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in running)
        return cls(num_queued_tokens=queued, kv_usage=kv_usage)


class DPRouter:
    """Routes new requests across `num_ranks` DP ranks.

    With `prefix_index` None (prefix caching off), routing is by load only.
    Otherwise a rank's hit is the number of leading full blocks of the
    request's tokens that the index says it caches, capped exactly as
    `KVCacheManager.get_computed_blocks` caps it: at most
    ``(num_tokens - 1) // block_size`` blocks, and none for requests with
    ``prompt_logprobs`` (they never use hits). So the chosen rank's own lookup,
    made right after, finds at least that many blocks unless they are evicted
    in between.
    """

    def __init__(self, num_ranks: int, block_size: int, prefix_index: PrefixIndex | None) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if prefix_index is not None and prefix_index.num_ranks != num_ranks:
            raise ValueError(
                f"prefix_index covers {prefix_index.num_ranks} ranks, router has {num_ranks}"
            )
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.prefix_index = prefix_index

    def route(self, request: Request, loads: Sequence[RankLoad]) -> int:
        """The rank for `request`: most hit blocks, then least load, then lowest rank."""
        if len(loads) != self.num_ranks:
            raise ValueError(f"expected {self.num_ranks} loads, got {len(loads)}")
        hits = self.prefix_hits(request)
        return min(range(self.num_ranks), key=lambda r: (-hits[r], loads[r].sort_key, r))

    def prefix_hits(self, request: Request) -> list[int]:
        """Per rank, how many leading blocks of `request` it could serve from cache."""
        index = self.prefix_index
        if index is None or request.sampling_params.prompt_logprobs is not None:
            return [0] * self.num_ranks
        return index.longest_prefix_hits(self.block_hashes(request))

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chain hashes of the blocks that may count as hits (see class doc).

        Hashes `all_token_ids`, which for a new request are its prompt; a
        request resumed with outputs is thereby matched the way its rank's
        KV cache manager will match it.
        """
        return hit_block_hashes(
            self.block_size, request.all_token_ids, request_extra_keys(request.cache_salt, request.lora_int_id)
        )
