"""Log-probabilities of given (not sampled) tokens: the prompt's own tokens."""

from __future__ import annotations

import torch

from rayvllm.messages.engine_types import LogprobsLists, LogprobsTensors


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Column 0: each row's `token_ids` entry; columns 1..num_top: the top
    tokens. Rank is 1 + the number of strictly larger logprobs."""
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))
    ranks = (logprobs > chosen).sum(-1) + 1
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat((token_ids.unsqueeze(-1), top_ids), dim=-1)
        vals = torch.cat((chosen, top_vals), dim=-1)
    else:
        ids, vals = token_ids.unsqueeze(-1), chosen
    return LogprobsTensors(ids, vals, ranks)


def prompt_logprobs_tensors(logits: torch.Tensor, targets: list[int], num_top: int) -> LogprobsTensors:
    """On `logits`' device: the targets go where the logits are."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, torch.tensor(targets, dtype=torch.int64, device=logits.device), num_top)


def compute_prompt_logprobs(logits: torch.Tensor, targets: list[int], num_top: int) -> LogprobsLists:
    return prompt_logprobs_tensors(logits, targets, num_top).tolists()
