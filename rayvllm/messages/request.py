"""A request as it crosses into the engine core (token ids in), and the
states and finish reasons it reports back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams


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

    `final_only`: the client wants the request's tokens only when it ends
    (set only where it needs nothing per step: no streaming, stop strings
    or logprobs). The core then sends its first token (its time is the
    request's TTFT) and, when it finishes, every token since in one output;
    none in between, so a step whose every request is quiet pushes nothing.
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
    final_only: bool = False
