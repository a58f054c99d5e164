"""Requests as the engine core sees them: token ids in, token ids out."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from rayvllm.lora.request import LoRARequest
from rayvllm.pooling_params import PoolingParams
from rayvllm.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class EngineCoreRequest:
    """What the Processor hands the engine core: fully tokenized and validated.

    `max_tokens` here is always concrete (the Processor resolves None against
    max_model_len). `eos_token_id` is None when the tokenizer has none.
    `output_token_ids` is empty for a new request; a request resumed on a
    restarted engine carries the tokens it had already produced, which the
    core takes as its output so far (recomputed as context, counted against
    max_tokens and penalties, a seeded generator advanced past them).

    A pooling request (`pooling_params` set) finishes once its prompt is
    computed, with the pooled vector and no token; its `sampling_params`
    (max_tokens=1, no stop ids) only keep the scheduler's length
    bookkeeping uniform: nothing samples with them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    # Set on the children of an n > 1 request; they share the prompt's blocks.
    parent_request_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    pooling_params: PoolingParams | None = None
    # The adapter to run with (None: the base model); checked by the Processor.
    lora_request: LoRARequest | None = None


class Request:
    """Scheduler-side state of one request.

    Invariants: `all_token_ids == prompt_token_ids + output_token_ids`;
    `0 <= num_computed_tokens <= num_tokens + num_output_placeholders`; a
    request is runnable while `num_computed_tokens < num_tokens +
    num_output_placeholders` (prefill, recompute or decode). Placeholders
    exist only under async scheduling: tokens that steps still on the workers
    will sample, which the workers already know and the scheduler not yet.
    """

    def __init__(self, core_req: EngineCoreRequest) -> None:
        self._core_request = core_req
        self.request_id = core_req.request_id
        self.sampling_params = core_req.sampling_params
        self.eos_token_id = core_req.eos_token_id
        self.arrival_time = core_req.arrival_time
        self.priority = core_req.priority
        self.cache_salt = core_req.cache_salt
        self.parent_request_id = core_req.parent_request_id
        self.pooling_params = core_req.pooling_params
        self.lora_request = core_req.lora_request
        self.prompt_token_ids = list(core_req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = list(core_req.output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
        self.first_scheduled_time: float | None = None  # time.time(), for the queue-time metric
        self.num_preemptions = 0
        # Scheduler bookkeeping for parallel groups: output tokens already
        # sent to the non-sampling ranks, and scheduled steps not yet returned.
        self.num_output_tokens_sent = 0
        self.num_inflight_steps = 0
        self.num_output_placeholders = 0
        # Drafts the worker proposed for this request's next step.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        assert core_req.sampling_params.max_tokens is not None
        self.max_tokens: int = core_req.sampling_params.max_tokens

    def resumed(self) -> EngineCoreRequest:
        """This request as a new engine core would take it: the prompt and
        the tokens produced so far (recomputed as context)."""
        return replace(self._core_request, output_token_ids=list(self.output_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether a cached prefix may stand in for computing it: not when
        every prompt position's output is wanted (prompt logprobs, mean pooling)."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is None and (pooling is None or pooling.pooling_type != "MEAN")

    @property
    def lora_int_id(self) -> int | None:
        """The adapter's id, None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status.finished

    def get_finished_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
