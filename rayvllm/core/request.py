"""The scheduler's mutable state of one request (vLLM's `Request`)."""

from __future__ import annotations

from dataclasses import replace

from rayvllm.messages.request import EngineCoreRequest, FinishReason, RequestStatus


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
        # A `final_only` request's tokens reach the client in two outputs:
        # its first and, at the end, the rest; this counts those it has.
        self.final_only = core_req.final_only
        self.num_output_tokens_emitted = len(self.output_token_ids)
        self.num_inflight_steps = 0
        self.num_output_placeholders = 0
        # Drafts the worker proposed for this request's next step.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        assert core_req.sampling_params.max_tokens is not None
        self.max_tokens: int = core_req.sampling_params.max_tokens

    def moved(self) -> "Request":
        """This request for a fresh scheduler (its rank's KV cache died): the
        prompt and the tokens produced so far, recomputed as context; the
        tokens its client was sent stay counted."""
        moved = Request(replace(self._core_request, output_token_ids=list(self.output_token_ids)))
        moved.num_output_tokens_emitted = self.num_output_tokens_emitted
        return moved

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
