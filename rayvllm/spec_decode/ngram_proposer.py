"""Prompt-lookup drafts (vLLM's "ngram" method): no second model.

The longest suffix of the request's tokens (prompt + output), from
`prompt_lookup_max` down to `prompt_lookup_min` tokens, that also occurs
earlier in them proposes the tokens that followed its earliest occurrence.
Text that echoes its input (code edits, quoting, extraction) gets long runs
of accepted drafts; text that does not finds no match and proposes nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from rayvllm.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) drafts to follow `tokens` (1-D int64)."""
        num = min(self.num_speculative_tokens, max_drafts)
        total = tokens.shape[0]
        if num <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows start at 0 .. total - n - 1: each is followed by at
            # least one token, and none is the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start : start + num].tolist()
        return []
