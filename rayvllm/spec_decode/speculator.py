"""The sampling rank's side of speculative decoding, an extension of the
model runner's step: verify the drafts the step scheduled, emit what each
request keeps, then propose the next drafts for every request that
produced a token."""

from __future__ import annotations

import torch

from rayvllm.config import SpeculativeConfig
from rayvllm.messages.engine_types import SpecDecodeOutput
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.extension_context import BeginStepContext, ModelLoadContext, SampleContext
from rayvllm.model_executor.input_batch import CachedRequestState
from rayvllm.models.interface import CausalLM
from rayvllm.spec_decode.draft_proposer import DraftModelProposer
from rayvllm.spec_decode.eligibility import can_speculate, past_min_tokens
from rayvllm.spec_decode.ngram_proposer import NgramProposer
from rayvllm.spec_decode.rejection_sampler import RejectionSampler, VerifyRequest, step_generator


class Speculator(ModelRunnerExtension):
    """`target_head_dim`: the target model's head size, which a draft
    model must share (one attention backend serves both)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, target_head_dim: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.drafter = DraftModelProposer(config, target_head_dim) if config.method == "draft_model" else None
        self.rejection_sampler = RejectionSampler()
        # The target's device, where seeded verification draws; set by load_model.
        self.device = torch.device("cpu")

    def load_model(self, ctx: ModelLoadContext) -> None:
        self.device = ctx.device
        if self.drafter is not None:
            self.drafter.load_model(ctx)

    def kv_cache_models(self) -> list[CausalLM]:
        return [] if self.drafter is None or self.drafter.model is None else [self.drafter.model]

    def begin_step(self, ctx: BeginStepContext) -> None:
        if self.drafter is not None:
            so = ctx.scheduler_output
            # A resumed request starts over, as its row in the batch does.
            self.drafter.forget([*so.finished_req_ids, *so.preempted_req_ids, *(n.req_id for n in so.scheduled_new_reqs)])

    def after_sample(self, ctx: SampleContext) -> None:
        """Verifies `ctx.verifying` (each request's k + 1 rows of
        `ctx.verify_logits` in turn), then drafts for them and for the
        requests that sampled one token the ordinary way."""
        out = ctx.spec_decode = SpecDecodeOutput()
        if ctx.verifying:
            drafts = ctx.drafts
            requests = [
                VerifyRequest(
                    s.sampling_params,
                    drafts[s.req_id],
                    step_generator(
                        s.sampling_params.seed if s.generator is not None else None,
                        len(s.output_token_ids), 0, self.device,
                    ),
                    self.drafter.draft_probs(s.req_id, len(drafts[s.req_id])) if self.drafter is not None else None,
                )
                for s in ctx.verifying
            ]
            result = self.rejection_sampler(ctx.verify_logits, requests)
            for state, tokens, logprobs in zip(ctx.verifying, result.token_ids, result.logprobs):
                ctx.emit_verified(state, tokens)
                out.token_ids[state.req_id] = tokens
                if logprobs is not None:
                    out.logprobs[state.req_id] = logprobs
        proposing: list[CachedRequestState] = []
        max_drafts: list[int] = []
        for state in (*ctx.sampling, *ctx.verifying):
            n = self._max_drafts(state)
            if n > 0:
                proposing.append(state)
                max_drafts.append(n)
        if not proposing:
            return
        if self.drafter is not None:
            out.draft_token_ids = self.drafter.propose(proposing, max_drafts, ctx.token_ids, ctx.forward_positions)
            return
        assert self.ngram is not None
        for state, n in zip(proposing, max_drafts):
            proposed = self.ngram.propose(ctx.token_ids[state.row, : state.num_tokens], n)
            if proposed:
                out.draft_token_ids[state.req_id] = proposed

    def _max_drafts(self, state: CachedRequestState) -> int:
        """How many drafts can serve `state` next step: none for a request
        that cannot speculate or just stopped; at most what max_model_len
        and max_tokens leave room for."""
        params = state.sampling_params
        output = state.output_token_ids
        if not can_speculate(params) or not past_min_tokens(params, len(output)):
            return 0
        if output and output[-1] in params.all_stop_token_ids:
            return 0
        assert params.max_tokens is not None
        return min(
            self.num_speculative_tokens,
            self.max_model_len - state.num_tokens,
            params.max_tokens - len(output) - 1,
        )
