"""Which requests may speculate.

Verification scores every draft position with the same sampling rule, so a
request qualifies only when its next-token distribution depends on nothing
the drafts change: no penalties (they count the tokens before each
position). A grammar does depend on them, and is followed instead: each
draft position gets the mask of the grammar advanced over the drafts before
it (`StructuredOutputManager.draft_bitmask`). min_tokens also bars stop ids
by position; the runner proposes for such a request only once its output
is long enough (`past_min_tokens`)."""

from __future__ import annotations

from rayvllm.messages.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    return not params.needs_penalties


def past_min_tokens(params: SamplingParams, num_output_tokens: int) -> bool:
    return num_output_tokens >= params.min_tokens
