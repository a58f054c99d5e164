"""What the scheduler tells the workers each step.

A request's full data crosses once, in `NewRequestData`, when it is first
scheduled (or resumed after preemption, when the worker has dropped it).
Afterwards only deltas cross in `CachedRequestData`: newly allocated block ids
and the computed-token count. Workers append the tokens they sample themselves,
so decode steps carry no token ids at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayvllm.messages.kv_transfers import KVTransfers
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Non-empty only when resuming after preemption: tokens already generated.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    # The request's adapter and the batch slot the scheduler gave it (-1: none).
    lora_request: LoRARequest | None = None
    lora_slot: int = -1


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Only when the group has ranks that do not sample (TP/PP > 1): tokens
    # sampled since the request was last scheduled, for those ranks to append.
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step's plan.

    Invariants: every id in `num_scheduled_tokens` is in exactly one of
    `scheduled_new_reqs` / `scheduled_cached_reqs`; `total_num_scheduled_tokens`
    is the sum of `num_scheduled_tokens.values()` and never exceeds the budget.
    `finished_req_ids` and `preempted_req_ids` name requests whose worker-side
    state must be dropped before this step runs. `kv_transfers`: copies
    between the KV cache and the second tier, made before the forward.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Speculative decoding: per request, the draft tokens scheduled after
    # its last token (counted in `num_scheduled_tokens`), for every rank to
    # feed and the sampling rank to verify.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_transfers: KVTransfers | None = None

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to compute or copy."""
        return self.total_num_scheduled_tokens == 0 and self.kv_transfers is None
