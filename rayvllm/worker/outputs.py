"""What a model runner returns for one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsTensors:
    """Row i: `logprob_token_ids[i, 0]` is the chosen (sampled or actual) token,
    columns 1.. the top-N tokens; `ranks[i]` is the chosen token's rank (1 = best)."""

    logprob_token_ids: torch.Tensor  # [R, N+1] int64
    logprobs: torch.Tensor  # [R, N+1] float32
    ranks: torch.Tensor  # [R] int64

    def tolists(self) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        )


@dataclass
class LogprobsLists:
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


@dataclass
class ModelRunnerOutput:
    """Invariant: `sampled_token_ids[i]` belongs to `req_ids[i]`, one token per
    request whose scheduled tokens reached the end of its sequence; requests in
    the middle of a chunked prefill are absent. `logprobs` rows align with
    `req_ids` when any of them asked for logprobs. `prompt_logprobs` holds, per
    request that asked, the rows for the prompt positions computed this step."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None
    prompt_logprobs: dict[str, LogprobsLists]
