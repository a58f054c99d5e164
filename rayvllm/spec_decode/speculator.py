"""The sampling rank's side of speculative decoding, called by the model
runner once per step: verify the drafts the step scheduled, append what
each request emits to the persistent batch, then propose the next drafts
for every request that produced a token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rayvllm.config import SpeculativeConfig
from rayvllm.messages.engine_types import SpecDecodeOutput
from rayvllm.spec_decode.draft_proposer import DraftModelProposer
from rayvllm.spec_decode.eligibility import can_speculate, past_min_tokens
from rayvllm.spec_decode.ngram_proposer import NgramProposer
from rayvllm.spec_decode.rejection_sampler import RejectionSampler, VerifyRequest, step_generator
from rayvllm.structured_output.bitmask import apply_token_bitmask_

if TYPE_CHECKING:
    from rayvllm.worker.input_batch import CachedRequestState
    from rayvllm.worker.model_runner import ModelRunner
    from rayvllm.worker.structured_outputs import StructuredOutputManager


class Speculator:
    def __init__(self, config: SpeculativeConfig, runner: "ModelRunner") -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.runner = runner
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.drafter = DraftModelProposer(config, runner) if config.method == "draft_model" else None
        self.rejection_sampler = RejectionSampler()

    def step(
        self,
        verify_states: list["CachedRequestState"],
        verify_logits: torch.Tensor,
        drafts: dict[str, list[int]],
        sampled_states: list["CachedRequestState"],
    ) -> SpecDecodeOutput:
        """`verify_logits`: each verifying request's k + 1 rows in turn;
        `sampled_states`: requests that sampled one token the ordinary way
        (already appended)."""
        batch = self.runner.input_batch
        out = SpecDecodeOutput()
        if verify_states:
            structured = self.runner.structured
            if structured is not None and structured.has_requests:
                _mask_drafts(structured, verify_states, verify_logits, drafts)
            requests = [
                VerifyRequest(
                    s.sampling_params,
                    drafts[s.req_id],
                    step_generator(
                        s.sampling_params.seed if s.generator is not None else None,
                        len(s.output_token_ids), 0, self.runner.device,
                    ),
                    self.drafter.draft_probs(s, len(drafts[s.req_id])) if self.drafter is not None else None,
                )
                for s in verify_states
            ]
            result = self.rejection_sampler(verify_logits, requests)
            for state, tokens, logprobs in zip(verify_states, result.token_ids, result.logprobs):
                if structured is not None:
                    structured.accept_tokens([state.req_id] * len(tokens), tokens)
                for token in tokens:
                    batch.append_token(state, token)
                out.token_ids[state.req_id] = tokens
                if logprobs is not None:
                    out.logprobs[state.req_id] = logprobs
        proposing: list[CachedRequestState] = []
        max_drafts: list[int] = []
        for state in (*sampled_states, *verify_states):
            n = self._max_drafts(state)
            if n > 0:
                proposing.append(state)
                max_drafts.append(n)
        if not proposing:
            return out
        if self.drafter is not None:
            out.draft_token_ids = self.drafter.propose(proposing, max_drafts)
            return out
        assert self.ngram is not None
        for state, n in zip(proposing, max_drafts):
            proposed = self.ngram.propose(batch.token_ids[state.row, : state.num_tokens], n)
            if proposed:
                out.draft_token_ids[state.req_id] = proposed
        return out

    def _max_drafts(self, state: "CachedRequestState") -> int:
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
            self.runner.max_model_len - state.num_tokens,
            params.max_tokens - len(output) - 1,
        )


def _mask_drafts(
    structured: "StructuredOutputManager",
    verify_states: list["CachedRequestState"],
    verify_logits: torch.Tensor,
    drafts: dict[str, list[int]],
) -> None:
    """Each constrained request's k + 1 verification rows under its
    grammar's masks (advanced over the drafts before each row), so the
    rejection sampler accepts only drafts the grammar allows and samples
    every other token from the masked distribution, as decoding would."""
    start = 0
    for state in verify_states:
        rows = len(drafts[state.req_id]) + 1
        bitmask = structured.draft_bitmask(state.req_id, drafts[state.req_id])
        if bitmask is not None:
            apply_token_bitmask_(verify_logits[start : start + rows], bitmask, None)
        start += rows
