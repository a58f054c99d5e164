"""Structured outputs on the runner's step: the matchers follow the
batch's requests, a step's bitmask is filled while its forward runs, and
applied to the sampling rows' logits (and to verifying requests' rows,
advanced over their drafts) before anything is sampled. The ordering rules
that keep this exact are in manager.py."""

from __future__ import annotations

from concurrent.futures import Future

from rayvllm.config import ModelConfig
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.extension_context import (
    BeginStepContext,
    LogitsContext,
    PrepareInputsContext,
    SampleContext,
)
from rayvllm.structured_output.bitmask import apply_token_bitmask_
from rayvllm.structured_output.manager import GrammarBitmask, StructuredOutputManager


class StructuredOutputExtension(ModelRunnerExtension):
    """Runs on the rank that samples. Must come after an extension that
    verifies drafts: it advances the matchers over the tokens that
    verification emits (`SampleContext.verified`)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.manager = StructuredOutputManager(model_config)
        # The running step's bitmask, being filled; None: no row constrained.
        self._fill: Future[GrammarBitmask] | None = None

    def begin_step(self, ctx: BeginStepContext) -> None:
        so = ctx.scheduler_output
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.manager.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.manager.add_request(new.req_id, new.sampling_params, new.output_token_ids)

    def prepare_inputs(self, ctx: PrepareInputsContext) -> None:
        self._fill = None
        if self.manager.has_requests:
            self._fill = self.manager.prepare_bitmask([s.req_id for s in ctx.sampling])

    def before_sample(self, ctx: LogitsContext) -> None:
        if self._fill is not None:
            masks = self._fill.result()
            apply_token_bitmask_(ctx.sampling_logits, masks.bitmask, masks.rows)
        if ctx.verifying and self.manager.has_requests:
            self._mask_drafts(ctx)

    def _mask_drafts(self, ctx: LogitsContext) -> None:
        """Each constrained request's k + 1 verification rows under its
        grammar's masks (advanced over the drafts before each row), so the
        rejection sampler accepts only drafts the grammar allows and samples
        every other token from the masked distribution, as decoding would."""
        verify_logits = ctx.verify_logits
        start = 0
        for state in ctx.verifying:
            drafts = ctx.drafts[state.req_id]
            bitmask = self.manager.draft_bitmask(state.req_id, drafts)
            if bitmask is not None:
                apply_token_bitmask_(verify_logits[start : start + len(drafts) + 1], bitmask, None)
            start += len(drafts) + 1

    def after_sample(self, ctx: SampleContext) -> None:
        if self._fill is not None:
            self.manager.accept_tokens([s.req_id for s in ctx.sampling], ctx.sampled_token_ids)
            self._fill = None
        for req_id, tokens in ctx.verified.items():
            self.manager.accept_tokens([req_id] * len(tokens), tokens)

    def shutdown(self) -> None:
        self.manager.shutdown()
