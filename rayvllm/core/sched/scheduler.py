"""The token-budget scheduler (vLLM v1's unified design).

There are no prefill and decode phases: each request has `num_computed_tokens`
chasing `num_tokens`, and each step hands out one budget of
`max_num_batched_tokens` tokens, first to running requests (decode or the next
chunk of a prefill), then to waiting ones (new, or resumed after preemption by
recompute). Prefix-cache hits simply start a request with computed tokens.
A request whose next blocks sit in the second KV tier waits one step in
`loading` while they are copied in, then starts with them as hits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from rayvllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from rayvllm.core.block_pool import BlockPoolListener
from rayvllm.core.kv_cache_manager import KVCacheManager
from rayvllm.core.kv_tier import KVTier
from rayvllm.core.request import Request
from rayvllm.core.sched.plugins import LoRASlotTable, SpeculationEligibility
from rayvllm.core.sched.request_queue import create_request_queue
from rayvllm.messages.engine_types import (
    EngineCoreOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerStats,
    SpecDecodeOutput,
    SpecDecodingStats,
)
from rayvllm.messages.request import FinishReason, RequestStatus
from rayvllm.messages.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the request queues and, through `KVCacheManager`, the KV blocks.

    Invariants: a request is in exactly one of `waiting` / `loading` /
    `running` until it finishes; every running request holds blocks for all its computed tokens
    that a later query can read (with `cache_config.sliding_window`, those within the window of its
    next token: see KVCacheManager); `len(running) <= max_num_seqs`.

    Pipelining (`max_inflight_steps > 1`): several scheduled steps may be
    on the workers at once. A request in flight is never preempted (its
    blocks may still be written); a prefill may send its next chunk (every
    stage runs steps in order, so the earlier chunk's KV is written first).
    Decoding requests wait for their token, except under async scheduling:
    then a step that will sample for a request adds an output placeholder,
    and the next step feeds that token, which the (single, sampling) worker
    has by the time it runs it. A request may then compute one token past
    its end (EOS, a stop id); that output is dropped, as it arrives after
    the request finished.

    Speculative decoding: a decoding request's drafts (proposed by the
    sampling worker with its last output) are scheduled after its last
    token, as far as the budget, max_model_len and max_tokens allow, with
    KV slots for them (plus `num_lookahead_tokens` for a draft model's own
    drafts). The output says how many were accepted, and the rejected ones'
    computed count is taken back, so their KV is overwritten and never
    hashed (hashes cover known tokens only). A request that can speculate
    gets no output placeholder under async scheduling: it waits for its
    output, whose drafts are then fresh, so each of its steps is exactly a
    synchronous step.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        send_token_ids: bool = False,
        max_inflight_steps: int = 1,
        listener: BlockPoolListener | None = None,
        speculative_config: SpeculativeConfig | None = None,
        can_speculate: SpeculationEligibility | None = None,
        lora_slots: LoRASlotTable | None = None,
        kv_tier: KVTier | None = None,
    ) -> None:
        """The features come built: `can_speculate` (given exactly when
        `speculative_config` is) picks the requests that may speculate;
        `lora_slots` (None: LoRA off) assigns adapters their batch slots;
        `kv_tier` (None: no second tier) backs the prefix cache."""
        if (speculative_config is None) != (can_speculate is None):
            raise ValueError("speculative_config and can_speculate come together")
        self.config = scheduler_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = scheduler_config.policy
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            listener=listener,
            kv_tier=kv_tier,
            sliding_window=cache_config.sliding_window,
        )
        # Ranks that do not sample need the sampled tokens in the next step.
        self.send_token_ids = send_token_ids
        self.track_inflight = max_inflight_steps > 1
        self.async_scheduling = scheduler_config.async_scheduling
        assert not (self.async_scheduling and send_token_ids), "async scheduling needs a sampling worker per group"
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Waiting requests whose blocks are being copied in from the KV tier.
        self.loading: dict[str, Request] = {}
        # Requests finished since the last step; the workers drop their state.
        self.finished_req_ids: set[str] = set()
        # Request id -> steps still in flight that were scheduled for an
        # earlier request of that id, freed meanwhile: their results belong
        # to it, never to a new request that reuses the id.
        self._stale_steps: dict[str, int] = {}
        self.num_preemptions = 0
        # Preempted between steps (`preempt_running`): the next step tells the workers.
        self._preempted_between_steps: set[str] = set()
        # Per n > 1 parent: the sibling that computes the shared prompt first.
        self._prompt_leaders: dict[str, Request] = {}
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self.spec_decoding_stats = (
            SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None
        )
        self.lora_slots = lora_slots
        self.can_speculate = can_speculate

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """A request whose id is still live here replaces it: the client
        holds one request per id, so the live one is an orphan its client
        has let go of (and stays finished there), and two requests under one
        id would share its KV bookkeeping."""
        if request.request_id in self.requests:
            logger.warning("request %s was added while one of that id was live; the old one is aborted",
                           request.request_id)
            self.abort_requests([request.request_id])
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Finish the named requests as aborted; returns the ids that were live."""
        aborted = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self.loading.pop(req_id, None) is None:
                self.waiting.remove(request)
            self._free_request(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(req_id)
        return aborted

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        parent = request.parent_request_id
        if parent is not None and self._prompt_leaders.get(parent) is request:
            del self._prompt_leaders[parent]
        self.kv_cache_manager.free(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        if request.num_inflight_steps:
            rid = request.request_id
            self._stale_steps[rid] = self._stale_steps.get(rid, 0) + request.num_inflight_steps
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted_ids: set[str] = set()
        kv = self.kv_cache_manager

        # Running requests first, in order: decodes and continuing chunks.
        scheduled_running: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}
        new_block_ids: dict[str, list[int]] = {}
        out_of_blocks = False
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            pending = request.num_output_placeholders
            num_new = min(request.num_tokens + pending - request.num_computed_tokens, budget)
            num_new = min(num_new, self.max_model_len - request.num_computed_tokens)
            if pending and self._ends_with_pending(request):
                num_new = 0
            if num_new <= 0:
                idx += 1
                continue
            num_spec = self._num_spec_to_schedule(request, num_new, budget) if request.spec_token_ids else 0
            num_new += num_spec
            while True:
                lookahead = self._lookahead(request, num_new) if self.num_lookahead_tokens else 0
                blocks = kv.allocate_slots(request, num_new + lookahead)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                if victim is None:
                    break
                if victim in scheduled_running:
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
            if blocks is None:
                if request.status == RequestStatus.RUNNING:
                    # Every possible victim is in flight: wait for them.
                    out_of_blocks = True
                    idx += 1
                # Otherwise `request` itself was preempted and left running.
                continue
            scheduled_running.append(request)
            if num_spec:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            idx += 1

        for request in scheduled_running:
            n = num_scheduled[request.request_id]
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids[request.request_id])
            cached.num_computed_tokens.append(request.num_computed_tokens)
            if self.send_token_ids:
                cached.new_token_ids.append(request.output_token_ids[request.num_output_tokens_sent :])
                request.num_output_tokens_sent = request.num_output_tokens
            # Advance now: later decisions in this step (siblings waiting on a
            # prompt) and the next schedule() see these tokens as in flight.
            request.num_computed_tokens += n
            if request.spec_token_ids:
                request.spec_token_ids = []  # scheduled or stale: the next output brings fresh ones
            self._add_placeholder_if_sampling(request)

        # Then waiting requests, unless this step had to preempt (no room).
        if not preempted_ids and not out_of_blocks:
            # A request loading from the KV tier runs next: it holds a seat.
            while len(self.waiting) and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
                request = self.waiting.peek()
                if self._wait_for_sibling(request):
                    break
                # Every slot is pinned by running requests of other adapters.
                if self.lora_slots is not None and not self.lora_slots.can_admit(request):
                    break
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                if kv.load_from_tier(request, hit_blocks):
                    self.waiting.pop()
                    self.loading[request.request_id] = request
                    continue
                num_new = request.num_tokens - num_hit
                if num_new > budget and not self.config.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                # Computed tokens are 0 while waiting.
                lookahead = self._lookahead(request, num_hit + num_new) if self.num_lookahead_tokens else 0
                blocks = kv.allocate_slots(request, num_new + lookahead, hit_blocks, num_hit)
                if blocks is None:
                    break
                self.waiting.pop()
                lora_slot = self.lora_slots.acquire(request) if self.lora_slots is not None else -1
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                    request.first_scheduled_time = time.time()
                request.num_computed_tokens = num_hit + num_new
                self._add_placeholder_if_sampling(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=kv.get_block_ids(request.request_id),
                        num_computed_tokens=num_hit,
                        pooling_params=request.pooling_params,
                        lora_request=request.lora_request,
                        lora_slot=lora_slot,
                    )
                )
                request.num_output_tokens_sent = request.num_output_tokens
                num_scheduled[request.request_id] = num_new
                budget -= num_new

        if self.track_inflight:
            for req_id in num_scheduled:
                self.requests[req_id].num_inflight_steps += 1
        total = self.max_num_batched_tokens - budget
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_ids | self._preempted_between_steps if self._preempted_between_steps
            else preempted_ids,
            scheduled_spec_decode_tokens=spec_tokens,
            kv_transfers=kv.take_transfers(),
        )
        self.finished_req_ids = set()
        if self._preempted_between_steps:
            self._preempted_between_steps = set()
        return output

    def _num_spec_to_schedule(self, request: Request, num_new: int, budget: int) -> int:
        """How many of a decoding request's drafts fit this step: within the
        budget, before max_model_len, and no more than max_tokens can use
        (the step also emits the target's own token after them)."""
        if num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        return max(0, min(
            len(request.spec_token_ids),
            budget - 1,
            self.max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
        ))

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past `num_new` scheduled tokens that a draft model writes
        while proposing, within max_model_len."""
        room = self.max_model_len - request.num_computed_tokens - num_new
        return max(0, min(self.num_lookahead_tokens, room))

    def _add_placeholder_if_sampling(self, request: Request) -> None:
        """Under async scheduling, count the token a step just scheduled
        will sample: its last position reaches every token the worker knows.
        A pooling request samples nothing: it ends with its prompt; a
        request that can speculate waits for its output instead (see the
        class docstring)."""
        if self.can_speculate is not None and self.can_speculate(request.sampling_params):
            return
        if self.async_scheduling and request.pooling_params is None and (
            request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders
        ):
            request.num_output_placeholders += 1

    def _ends_with_pending(self, request: Request) -> bool:
        """Whether the tokens already in flight finish the request by length,
        so another step for it could only compute waste."""
        pending = request.num_output_placeholders
        return (
            request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens + pending >= self.max_model_len
        )

    def _wait_for_sibling(self, request: Request) -> bool:
        """Hold an n > 1 child back while a sibling is still computing the
        prompt (with prefix caching on): once the prompt's full blocks are
        cached, the child hits them and shares them instead of recomputing.
        A leader whose prompt is scheduled to completion this step releases
        its siblings in the same step, as its blocks are cached on allocation."""
        parent = request.parent_request_id
        if parent is None or not self.kv_cache_manager.enable_caching:
            return False
        leader = self._prompt_leaders.get(parent)
        if leader is None or leader.is_finished() or leader.status != RequestStatus.RUNNING:
            self._prompt_leaders[parent] = request
            return False
        if leader is request:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _pick_victim(self) -> Request | None:
        candidates = self.running
        if self.track_inflight:
            candidates = [r for r in self.running if r.num_inflight_steps == 0]
            if not candidates:
                return None
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def preempt_running(self) -> None:
        """Preempt every running request, by recompute, keeping their order
        at the head of the queue: their KV is computed again when they are
        scheduled next (under new weights, after an update). Only between
        steps, with none in flight (the engine loop took them back)."""
        for request in reversed(list(self.running)):
            self._preempt(request)
            self._preempted_between_steps.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # Only requests with nothing in flight are preempted.
        assert request.num_output_placeholders == 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ---- results back ----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stale: set[str] = set()  # scheduled for a request freed since (steps return in order)
        if self.track_inflight:
            for req_id in scheduler_output.num_scheduled_tokens:
                left = self._stale_steps.get(req_id)
                if left:
                    stale.add(req_id)
                    if left == 1:
                        del self._stale_steps[req_id]
                    else:
                        self._stale_steps[req_id] = left - 1
                    continue
                live = self.requests.get(req_id)
                if live is not None:
                    live.num_inflight_steps -= 1
        if scheduler_output.kv_transfers is not None:
            done = self.kv_cache_manager.finish_transfers(
                scheduler_output.kv_transfers, runner_output.kv_load_failures
            )
            # Back to the front, in the order they left.
            for req_id in reversed(done):
                request = self.loading.pop(req_id, None)
                if request is not None:
                    self.waiting.prepend(request)
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        emitted: set[str] = set()
        for i, req_id in enumerate(runner_output.req_ids):
            request = None if req_id in stale else self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            token = runner_output.sampled_token_ids[i]
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            request.append_output_token_ids([token])
            status, stop_reason = self._check_stop(request, token)
            if request.final_only and not _emits(request, status):
                continue
            out = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=_take_unemitted(request) if request.final_only else [token],
                new_logprobs=logprobs.slice(i, i + 1) if logprobs is not None else None,
                new_prompt_logprobs=prompt_logprobs.get(req_id),
                num_cached_tokens=request.num_cached_tokens,
                first_scheduled_time=request.first_scheduled_time if request.num_output_tokens == 1 else None,
            )
            if status is not None:
                self._finish_with(request, out, status, stop_reason)
            outputs.append(out)
            emitted.add(req_id)
        if runner_output.spec_decode is not None:
            self._update_from_spec_decode(scheduler_output, runner_output.spec_decode, outputs, emitted, stale)
        for req_id, pooled in runner_output.pooler_output.items():
            request = None if req_id in stale else self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._free_request(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.STOP,
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=request.first_scheduled_time,
                    pooling_output=pooled,
                )
            )
        # Prompt logprobs of chunks that sampled nothing still stream out.
        for req_id, lp in prompt_logprobs.items():
            if req_id not in emitted and req_id in self.requests:
                outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], new_prompt_logprobs=lp))
        return outputs

    def _update_from_spec_decode(
        self,
        scheduler_output: SchedulerOutput,
        spec: SpecDecodeOutput,
        outputs: list[EngineCoreOutput],
        emitted: set[str],
        stale: set[str],
    ) -> None:
        """Emit each verifying request's accepted run up to its first stop
        (the rest is dropped), take back the rejected drafts' computed
        count, then store the drafts proposed for the next step."""
        stats = self.spec_decoding_stats
        assert stats is not None
        for req_id, tokens in spec.token_ids.items():
            request = None if req_id in stale else self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            num_draft = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            num_accepted = len(tokens) - 1
            request.num_computed_tokens -= num_draft - num_accepted
            stats.observe(num_draft, num_accepted)
            status = stop_reason = None
            num_kept = 0
            for token in tokens:
                request.append_output_token_ids([token])
                num_kept += 1
                status, stop_reason = self._check_stop(request, token)
                if status is not None:
                    break
            emitted.add(req_id)
            if request.final_only and not _emits(request, status):
                continue
            logprobs: LogprobsLists | None = spec.logprobs.get(req_id)
            out = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=_take_unemitted(request) if request.final_only else tokens[:num_kept],
                new_logprobs=logprobs.slice(0, num_kept) if logprobs is not None else None,
                num_cached_tokens=request.num_cached_tokens,
            )
            if status is not None:
                self._finish_with(request, out, status, stop_reason)
            outputs.append(out)
        for req_id, drafts in spec.draft_token_ids.items():
            request = None if req_id in stale else self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING and not request.num_output_placeholders:
                request.spec_token_ids = drafts

    def _finish_with(
        self, request: Request, out: EngineCoreOutput, status: RequestStatus, stop_reason: int | None
    ) -> None:
        request.stop_reason = stop_reason
        out.finish_reason = status.finish_reason
        out.stop_reason = stop_reason
        self.running.remove(request)
        self._free_request(request, status)

    def _check_stop(self, request: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
            # vLLM reports the EOS token as stop_reason None, other stop ids by value.
            return RequestStatus.FINISHED_STOPPED, (None if token == request.eos_token_id else token)
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED, None
        return None, None

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.loading),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=None if self.spec_decoding_stats is None else self.spec_decoding_stats.copy(),
            kv_offload_stats=self.kv_cache_manager.make_offload_stats(),
        )


def _emits(request: Request, status: RequestStatus | None) -> bool:
    """Whether a `final_only` request sends its tokens this step: its first
    (the client times the first token) and when it ends."""
    return status is not None or request.num_output_tokens_emitted == 0


def _take_unemitted(request: Request) -> list[int]:
    """A `final_only` request's tokens since its last output."""
    tokens = request.output_token_ids[request.num_output_tokens_emitted :]
    request.num_output_tokens_emitted = request.num_output_tokens
    return tokens
