"""Verification of drafts against the target model: rejection sampling that
leaves the output distribution exactly the target's.

A request with k drafts d_1..d_k arrives with k + 1 rows of target logits:
row j scores the position after d_j (row 0: after the request's last
token). Greedy requests keep the drafts while each equals the target's
argmax and then emit the argmax of the first row that disagrees (or of
row k): the very tokens greedy decoding would produce one by one.

Random requests use the standard scheme (Leviathan et al., Chen et al.):
draft d_j, drawn from the proposer's distribution q_j, is accepted with
probability min(1, p_j(d_j) / q_j(d_j)), p_j being the target's processed
distribution (temperature, min_p, top-k, top-p, logit bias) at row j; at
the first rejection the row's token is drawn from norm(max(p_j - q_j, 0))
and the rest are dropped; when all are accepted a bonus token is drawn
from p_k. Each emitted token is then distributed exactly as p given the
tokens before it. An n-gram proposer is deterministic: q_j is one-hot, so
d_j is kept with probability p_j(d_j) and the residual is p_j without d_j.

Random draws: k + 1 float64 uniforms per verification (k acceptance tests,
one for the final draw); a seeded request draws them from `step_generator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayvllm.messages.engine_types import LogprobsLists
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.model_executor.prompt_logprobs import compute_prompt_logprobs
from rayvllm.model_executor.sampler import argmax_rows, categorical_inverse_cdf, top_k_top_p_candidates


def step_generator(seed: int | None, num_output_tokens: int, purpose: int, device: torch.device) -> torch.Generator | None:
    """A seeded request's generator for one speculative step's draws
    (`purpose` 0: verification, 1 + j: draft j), keyed by its output length.

    Not the request's own stream: a step emits a varying number of tokens,
    so after a preemption that stream, advanced one draw per token, would
    hand out draws already spent on the tokens before, and correlate them
    with what follows. Keys never repeat: every step starts at a new output
    length, before a preemption as after it. None for unseeded requests
    (the global generator)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(hash((seed, num_output_tokens, purpose)) & ((1 << 63) - 1))
    return generator


@dataclass
class VerifyRequest:
    """One request's drafts and what verifying them needs. `draft_probs`:
    [k, V] distributions the drafts were drawn from (None: one-hot, as an
    n-gram proposer's)."""

    sampling_params: SamplingParams
    draft_token_ids: list[int]
    generator: torch.Generator | None
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """Per request, the emitted tokens (1..k+1) and, when it asked, their
    logprobs (raw target logits, as the sampler reports)."""

    token_ids: list[list[int]]
    logprobs: list[LogprobsLists | None]


def apply_logit_bias_(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
    return logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of each row of `logits` (float32) under a
    random request's `params` (logit bias, temperature, min_p, top-k,
    top-p): in place on `logits`, returns the probs."""
    vocab = logits.shape[-1]
    x = apply_logit_bias_(logits, params)
    x = x.div_(params.temperature) if params.temperature != 1.0 else x
    if params.min_p > 0.0:
        threshold = x.amax(-1, keepdim=True) + torch.log(torch.tensor(params.min_p))
        x.masked_fill_(x < threshold, float("-inf"))
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k or params.top_p < 1.0:
        rows = x.shape[0]
        groups = top_k_top_p_candidates(
            x,
            torch.full((rows,), top_k, dtype=torch.int64, device=x.device),
            torch.full((rows,), params.top_p, device=x.device) if params.top_p < 1.0 else None,
            top_k,
            params.top_p < 1.0 and top_k == 0,
        )
        # Same threshold rule as the sampler's exponential race: tokens tied
        # with the last candidate stay eligible.
        for group in groups:
            cutoff = group.cutoff().unsqueeze(1)
            if group.rows is None:
                x.masked_fill_(x < cutoff, float("-inf"))
            else:
                sub = x.index_select(0, group.rows)
                x.index_copy_(0, group.rows, sub.masked_fill_(sub < cutoff, float("-inf")))
    return torch.softmax(x, dim=-1)


def _uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> list[float]:
    return torch.rand(n, dtype=torch.float64, generator=generator, device=device).tolist()


def _draw(weights: torch.Tensor, u: float) -> int:
    uniform = torch.tensor([u], dtype=torch.float64, device=weights.device)
    return int(categorical_inverse_cdf(weights.unsqueeze(0), uniform)[0])


def _verify_random(probs: torch.Tensor, req: VerifyRequest) -> list[int]:
    drafts = req.draft_token_ids
    k = len(drafts)
    u = _uniforms(k + 1, req.generator, probs.device)
    rows = torch.arange(k, device=probs.device)
    cols = torch.tensor(drafts, device=probs.device)
    p_drafts = probs[rows, cols].tolist()
    q = req.draft_probs
    q_drafts = [1.0] * k if q is None else q[rows, cols].tolist()
    out: list[int] = []
    for j, token in enumerate(drafts):
        # u < p / q without dividing: q > 0 for a drawn draft.
        if u[j] * q_drafts[j] < p_drafts[j]:
            out.append(token)
            continue
        if q is None:
            residual = probs[j].clone()
            residual[token] = 0.0
        else:
            residual = (probs[j] - q[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:
            # Rejection has probability 0 here; float rounding got us in.
            residual = probs[j]
        out.append(_draw(residual, u[k]))
        return out
    out.append(_draw(probs[k], u[k]))
    return out


def _verify_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """`target`: the argmax of each of the request's k + 1 rows."""
    out: list[int] = []
    for j, token in enumerate(drafts):
        out.append(target[j])
        if token != target[j]:
            return out
    out.append(target[len(drafts)])
    return out


class RejectionSampler:
    """Verifies a batch of requests' drafts; stateless."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[VerifyRequest]) -> VerifyResult:
        """`logits`: [sum(k_i + 1), V], each request's k_i + 1 rows in turn."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        tokens: list[list[int]] = []
        logprobs: list[LogprobsLists | None] = []
        # One argmax over every row serves the greedy requests without a bias.
        plain_greedy = [r.sampling_params.greedy and not r.sampling_params.logit_bias for r in requests]
        argmax = argmax_rows(logits).tolist() if any(plain_greedy) else []
        start = 0
        for req, plain in zip(requests, plain_greedy):
            end = start + len(req.draft_token_ids) + 1
            rows = logits[start:end]
            params = req.sampling_params
            if plain:
                emitted = _verify_greedy(argmax[start:end], req.draft_token_ids)
            elif params.greedy:
                biased = argmax_rows(apply_logit_bias_(rows.clone(), params)).tolist()
                emitted = _verify_greedy(biased, req.draft_token_ids)
            else:
                emitted = _verify_random(target_probs(rows.clone(), params), req)
            tokens.append(emitted)
            logprobs.append(
                None if params.logprobs is None
                else compute_prompt_logprobs(rows[: len(emitted)], emitted, params.logprobs)
            )
            start = end
        return VerifyResult(tokens, logprobs)
