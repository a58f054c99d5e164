"""Rejection sampling keeps the output distribution exactly the target's.

Two levels, both seeded (every draw comes from a fixed seed, so each test
is deterministic: it passes or fails the same way on every run):
- the rejection sampler alone, on fixed target logits: the token emitted
  at each draft position, whether the draft is kept or replaced, follows
  the target's distribution (chi-square goodness of fit against the exact
  probabilities), for one-hot drafts (n-gram) and drafts drawn from a q;
- the whole engine: seeded random continuations with a draft model have
  the same token distribution at every position as without speculation
  (two-sample chi-square over many requests).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from rayvllm import LLM, SamplingParams
from rayvllm.spec_decode.rejection_sampler import RejectionSampler, VerifyRequest

TRIALS = 2000
# Far below any p-value a correct sampler gives with these seeds, far above
# what a wrong distribution gets with this many draws.
ALPHA = 1e-3


def _exact(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution computed independently: top-k mask, then
    softmax at the temperature."""
    x = logits / params.temperature
    if params.top_k:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.softmax(x, dim=-1)


def _goodness_of_fit(samples: list[int], probs: torch.Tensor) -> float:
    """p-value of `samples` against `probs`; tokens of probability 0 must
    never appear."""
    counts = Counter(samples)
    support = [t for t in range(probs.shape[0]) if probs[t] > 0]
    assert set(counts) <= set(support)
    observed = [counts.get(t, 0) for t in support]
    total = float(probs.double()[support].sum())
    expected = [float(probs[t]) / total * len(samples) for t in support]
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("draft_kind", ["one_hot", "from_q"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
], ids=["plain", "temp-topk"])
def test_every_position_follows_the_target(draft_kind: str, params: SamplingParams) -> None:
    k, vocab = 3, 6
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    exact = _exact(logits, params)
    q = torch.softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(6)), dim=-1)
    draft_rng = torch.Generator().manual_seed(7)
    sampler = RejectionSampler()
    by_position: list[list[int]] = [[] for _ in range(k + 1)]
    accepted = 0
    for trial in range(TRIALS):
        if draft_kind == "one_hot":
            # Fixed drafts, as prompt lookup proposes: a likely and unlikely ones.
            drafts, draft_probs = [int(exact[0].argmax()), 1, int(exact[2].argmax())], None
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=draft_rng)) for j in range(k)]
            draft_probs = q
        generator = torch.Generator().manual_seed(trial)
        tokens = sampler(logits.clone(), [VerifyRequest(params, drafts, generator, draft_probs)]).token_ids[0]
        accepted += len(tokens) - 1
        # Position j is reached only after j accepted drafts; the target's
        # rows do not depend on them here, so each position's token follows
        # its row whatever came before.
        for j, token in enumerate(tokens):
            by_position[j].append(token)
    assert accepted > 0
    for j in range(k + 1):
        if len(by_position[j]) >= 200:
            assert _goodness_of_fit(by_position[j], exact[j]) > ALPHA, f"position {j}"


def test_greedy_rows_keep_drafts_up_to_the_first_disagreement() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    sampler = RejectionSampler()
    assert sampler(logits, [VerifyRequest(greedy, [1, 0], None)]).token_ids == [[1, 0, 2]]
    assert sampler(logits, [VerifyRequest(greedy, [1, 2], None)]).token_ids == [[1, 0]]
    assert sampler(logits, [VerifyRequest(greedy, [2, 0], None)]).token_ids == [[1]]
    biased = SamplingParams(temperature=0.0, logit_bias={2: 5.0})
    both = sampler(logits.repeat(2, 1)[:5], [VerifyRequest(greedy, [1, 0], None), VerifyRequest(biased, [2], None)])
    assert both.token_ids == [[1, 0, 2], [2, 2]]


REQUESTS = 400
POSITIONS = 4


def _continuations(llm: LLM, prompt: list[int], first_seed: int) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0.8, top_k=5, max_tokens=POSITIONS, seed=first_seed + i, ignore_eos=True)
        for i in range(REQUESTS)
    ]
    outs = llm.generate([{"prompt_token_ids": prompt}] * REQUESTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_distribution_with_a_draft_model_equals_without(draft_pair: tuple[Path, Path]) -> None:
    target, draft = draft_pair
    prompt = [11, 42, 97, 13, 250, 7, 11, 42, 97, 13, 250, 7, 11, 42]
    engine = dict(max_model_len=128, max_num_seqs=64, kv_cache_memory_bytes=64 << 20)
    plain = LLM(str(target), **engine)
    spec = LLM(str(target), **engine, speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    try:
        # Disjoint seeds: the two samples are independent.
        without = _continuations(plain, prompt, 0)
        with_spec = _continuations(spec, prompt, REQUESTS)
        stats = spec.llm_engine.engine_core.make_stats().spec_decoding_stats
    finally:
        plain.shutdown()
        spec.shutdown()
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for pos in range(POSITIONS):
        a = Counter(t[pos] for t in without)
        b = Counter(t[pos] for t in with_spec)
        # Tokens seen fewer than 10 times in both samples share one bin.
        common = sorted(t for t in set(a) | set(b) if a[t] + b[t] >= 10)
        rest = [sum(c[t] for t in c if t not in common) for c in (a, b)]
        table = [[a[t] for t in common] + [rest[0]], [b[t] for t in common] + [rest[1]]]
        if not any(rest):
            table = [row[:-1] for row in table]
        assert chi2_contingency(table).pvalue > ALPHA, f"position {pos}"
