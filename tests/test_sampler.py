"""Sampler and sampling-metadata tests (vLLM v1 semantics).

Every random test uses a fixed seed, so each is deterministic and cannot
flake; the statistical bounds are loose on top of that.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from rayvllm.messages.engine_types import LogprobsTensors
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.model_executor.prompt_logprobs import prompt_logprobs_tensors
from rayvllm.model_executor.sampler import (
    Sampler,
    _Candidates,
    argmax_rows,
    categorical_inverse_cdf,
    exp_weights_,
    top_k_top_p_candidates,
    topk_rows,
)
from rayvllm.model_executor.sampling_metadata import (
    RequestSamplingState,
    SamplingMetadata,
    build_sampling_metadata,
)

METHODS = ["inverse_cdf", "exponential_race"]
NEG_INF = float("-inf")


def state(
    sp: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    eos: int | None = None,
) -> RequestSamplingState:
    gen = None
    if seed is not None:
        gen = torch.Generator()
        gen.manual_seed(seed)
    return RequestSamplingState(
        sampling_params=sp,
        prompt_token_ids=list(prompt or []),
        output_token_ids=list(output or []),
        generator=gen,
        eos_token_id=eos,
    )


def run(
    logits: torch.Tensor,
    states: list[RequestSamplingState],
    method: str = "inverse_cdf",
) -> tuple[torch.Tensor, SamplingMetadata, LogprobsTensors | None]:
    md = build_sampling_metadata(states, logits.shape[-1])
    out = Sampler(method)(logits.clone(), md)  # type: ignore[arg-type]
    return out.sampled_token_ids, md, out.logprobs


def processed_logits(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """The logits after bias/min_tokens/penalties, via the sampler itself."""
    md = build_sampling_metadata(states, logits.shape[-1])
    work = logits.clone()
    Sampler._apply_logit_bias(work, md)
    Sampler._apply_min_tokens(work, md)
    Sampler._apply_penalties(work, md)
    return work


# --- greedy ------------------------------------------------------------------


def test_all_greedy_metadata_creates_nothing() -> None:
    states = [state(SamplingParams(temperature=0.0)) for _ in range(8)]
    md = build_sampling_metadata(states, 100)
    assert md.all_greedy and not md.all_random
    assert not md.needs_processing
    assert md.max_num_logprobs is None
    assert md.temperature is None and md.top_k is None and md.random_rows is None


@pytest.mark.parametrize("shape", [(3, 17), (64, 32000), (5, 1000), (2, 257)])
def test_temperature_zero_is_argmax(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*shape, generator=g)
    states = [state(SamplingParams(temperature=0.0)) for _ in range(shape[0])]
    ids, _, lp = run(logits, states)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, logits.argmax(-1))
    assert lp is None


def test_argmax_rows_matches_torch_including_ties_and_tail() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3000, generator=g)
    # Ties across chunks and inside the short tail chunk: first index wins.
    x[0, 10] = x[0, 2900] = 100.0
    x[1, 2999] = x[1, 2995] = 100.0
    x[2, 255] = x[2, 256] = 50.0
    x[3, :] = 0.0
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@pytest.mark.parametrize("shape_k", [(4, 32000, 50), (3, 20000, 1), (2, 151936, 20), (3, 900, 5)])
def test_topk_rows_matches_torch_topk(shape_k: tuple[int, int, int]) -> None:
    b, v, k = shape_k
    g = torch.Generator().manual_seed(16)
    x = torch.randn(b, v, generator=g)
    x[0, -3:] = 50.0  # winners in the short tail chunk
    x[-1, :: v // 7] = 40.0  # tied winners spread over many chunks
    vals, ids = topk_rows(x, k)
    ref = x.topk(k, dim=-1)
    assert torch.equal(vals, ref.values)
    assert torch.equal(x.gather(1, ids), vals)  # indices point at the values
    assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("method", METHODS)
def test_top_k_one_equals_greedy(method: str) -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 500, generator=g)
    states = [
        state(SamplingParams(temperature=0.3 + i * 0.2, top_k=1), seed=i if i % 2 else None)
        for i in range(16)
    ]
    torch.manual_seed(0)
    ids, md, _ = run(logits, states, method)
    assert md.all_random
    assert torch.equal(ids, logits.argmax(-1))


@pytest.mark.parametrize("method", METHODS)
def test_mixed_batch_greedy_rows_stay_greedy(method: str) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g)
    states = [
        state(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5), seed=i)
        for i in range(6)
    ]
    ids, md, _ = run(logits, states, method)
    assert not md.all_greedy and not md.all_random
    assert md.random_rows is not None and md.random_rows.tolist() == [1, 3, 5]
    assert torch.equal(ids[0::2], logits[0::2].argmax(-1))


# --- seeded determinism ------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_repeats_and_ignores_batch_composition(method: str) -> None:
    vocab = 1000
    g = torch.Generator().manual_seed(4)
    steps = [torch.randn(vocab, generator=g) for _ in range(6)]
    sp = SamplingParams(temperature=1.0, seed=1234)

    def tokens(batch_size: int, row: int, neighbours: SamplingParams) -> list[int]:
        seeded = state(sp, seed=1234)
        others = [state(neighbours, seed=None) for _ in range(batch_size - 1)]
        batch = others[:row] + [seeded] + others[row:]
        got = []
        for step_logits in steps:
            logits = torch.randn(batch_size, vocab, generator=g)
            logits[row] = step_logits
            ids, _, _ = run(logits, batch, method)
            got.append(int(ids[row]))
        return got

    alone = tokens(1, 0, sp)
    assert tokens(1, 0, sp) == alone
    assert tokens(5, 3, SamplingParams(temperature=0.7, top_p=0.9)) == alone
    assert tokens(4, 0, SamplingParams(temperature=0.0)) == alone
    assert tokens(7, 6, SamplingParams(temperature=2.0, top_k=5, min_p=0.1)) == alone
    # Several distinct tokens, so the check above is not trivially constant.
    assert len(set(alone)) > 1


@pytest.mark.parametrize("method", METHODS)
def test_seeded_truncated_row_ignores_neighbours_truncation(method: str) -> None:
    """The seeded row's candidates are computed at different widths (its own
    top_k, a neighbour's larger top_k, the top-p prefilter, a full sort for a
    flat neighbour), yet its tokens must not change."""
    vocab = 3000
    g = torch.Generator().manual_seed(11)
    steps = [torch.randn(vocab, generator=g) * 2.0 for _ in range(8)]
    flat = torch.randn(vocab, generator=g) * 0.01
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02, seed=99)
    neighbour_sets = [
        [],
        [SamplingParams(temperature=1.0, top_k=2500)],
        [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.0)],
        [SamplingParams(temperature=1.0, top_p=0.99)],  # flat row: full sort
    ]
    results = []
    for neighbours in neighbour_sets:
        batch = [state(n) for n in neighbours] + [state(sp, seed=99)]
        got = []
        for step_logits in steps:
            logits = torch.stack([flat] * len(neighbours) + [step_logits])
            got.append(int(run(logits, batch, method)[0][-1]))
        results.append(got)
    assert all(r == results[0] for r in results)
    assert len(set(results[0])) > 1


@pytest.mark.parametrize("method", METHODS)
def test_advance_generator_resumes_the_stream(method: str) -> None:
    """A request preempted after k tokens and resumed with a generator
    rebuilt from its seed and advanced k steps samples what it would have."""
    vocab = 700
    g = torch.Generator().manual_seed(15)
    steps = [torch.randn(1, vocab, generator=g) for _ in range(7)]
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=5)
    sampler = Sampler(method)  # type: ignore[arg-type]

    def draw(st: RequestSamplingState, logits: torch.Tensor) -> int:
        md = build_sampling_metadata([st], vocab)
        return int(sampler(logits.clone(), md).sampled_token_ids[0])

    straight = state(sp, seed=5)
    expected = [draw(straight, x) for x in steps]
    resumed = state(sp, seed=5)
    assert resumed.generator is not None
    sampler.advance_generator(resumed.generator, 4, vocab)
    assert [draw(resumed, x) for x in steps[4:]] == expected[4:]


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 5000)
    a = int(run(logits, [state(SamplingParams(seed=1), seed=1)])[0][0])
    b = int(run(logits, [state(SamplingParams(seed=2), seed=2)])[0][0])
    assert a != b


# --- truncation --------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_random_sampling_respects_top_k(method: str) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 2000, generator=g)
    ks = [1, 2, 5, 10, 50, 0, 3, 7]
    states = [state(SamplingParams(temperature=1.5, top_k=k)) for k in ks]
    torch.manual_seed(0)
    seen: list[set[int]] = [set() for _ in ks]
    for _ in range(200):
        ids, _, _ = run(logits, states, method)
        for r, t in enumerate(ids.tolist()):
            seen[r].add(t)
    for r, k in enumerate(ks):
        if k:
            allowed = set(logits[r].topk(k).indices.tolist())
            assert seen[r] <= allowed
            assert len(seen[r]) > 1 or k == 1
    assert len(seen[5]) > 50  # no top-k: draws spread over the vocabulary


@pytest.mark.parametrize("method", METHODS)
def test_random_sampling_respects_top_p(method: str) -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(3, 1)
    states = [
        state(SamplingParams(temperature=1.0, top_p=0.7)),  # nucleus {1, 3}
        state(SamplingParams(temperature=1.0, top_p=0.81)),  # {1, 3, 2}
        state(SamplingParams(temperature=1.0, top_p=0.4)),  # {1}
    ]
    torch.manual_seed(0)
    seen: list[Counter[int]] = [Counter() for _ in states]
    for _ in range(400):
        ids, _, _ = run(logits, states, method)
        for r, t in enumerate(ids.tolist()):
            seen[r][t] += 1
    assert set(seen[0]) == {1, 3}
    assert set(seen[1]) == {1, 2, 3}
    assert set(seen[2]) == {1}
    # Renormalised nucleus {0.5, 0.3}: token 1 has probability 0.625.
    assert abs(seen[0][1] / 400 - 0.625) < 0.08


@pytest.mark.parametrize("method", METHODS)
def test_random_sampling_respects_min_p(method: str) -> None:
    probs = torch.tensor([0.4, 0.3, 0.1, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    # Threshold 0.3 * 0.4 = 0.12: tokens 2 (0.1) and 4 (0.05) are dropped.
    states = [state(SamplingParams(temperature=1.0, min_p=0.3))]
    torch.manual_seed(0)
    seen = Counter(int(run(logits, states, method)[0]) for _ in range(400))
    assert set(seen) == {0, 1, 3}


def _reference_cutoff(row: torch.Tensor, k: int, p: float) -> float:
    """Full-sort top-k then top-p on the renormalised top-k distribution."""
    vals = row.sort(descending=True).values
    if k:
        vals = vals[:k]
    probs = torch.softmax(vals.double(), -1)
    before = torch.cumsum(probs, 0) - probs
    n = int((before < p).sum()) if p < 1.0 else len(vals)
    return float(vals[max(n, 1) - 1])


@pytest.mark.parametrize("v", [5000, 40000])
def test_truncation_cutoff_matches_full_sort_reference(v: int) -> None:
    g = torch.Generator().manual_seed(6)
    # Peaked rows resolve inside the prefilter; flat rows need wider retries
    # (at 40000: 1024 -> 8192 columns -> full sort for the flattest).
    logits = torch.cat(
        [
            torch.randn(4, v, generator=g) * 6.0,
            torch.randn(2, v, generator=g) * 0.01,
            torch.randn(2, v, generator=g) * 0.6,
        ]
    )
    ks = [0, 20, 0, 300, 0, 200, 0, 7]
    ps = [0.9, 0.8, 1.0, 0.95, 0.5, 0.99, 0.7, 1.0]
    groups = top_k_top_p_candidates(
        logits,
        torch.tensor(ks),
        torch.tensor(ps),
        max_top_k=max(ks),
        top_p_without_top_k=True,
    )
    if v > 4 * 1024:
        assert len(groups) >= 2  # some rows needed a wider retry
    cut = torch.full((8,), float("nan"))
    for group in groups:
        rows = torch.arange(8) if group.rows is None else group.rows
        cut[rows] = group.cutoff()
    for r in range(8):
        k, p = ks[r], ps[r]
        if k == 0 and p >= 1.0:
            continue  # such rows are never sent to truncation
        ref = _reference_cutoff(logits[r], k, p)
        assert float(cut[r]) == pytest.approx(ref, abs=1e-6), r


@pytest.mark.parametrize("method", METHODS)
def test_top_p_large_vocab_stays_in_nucleus(method: str) -> None:
    g = torch.Generator().manual_seed(7)
    v = 20000
    # Row 0 is flat (its nucleus overflows the prefilter), row 1 is peaked.
    logits = torch.stack([torch.randn(v, generator=g) * 0.05, torch.randn(v, generator=g) * 4])
    states = [state(SamplingParams(temperature=1.0, top_p=0.3)) for _ in range(2)]
    cutoffs = [_reference_cutoff(logits[r], 0, 0.3) for r in range(2)]
    torch.manual_seed(0)
    seen: list[set[int]] = [set(), set()]
    for _ in range(20):
        ids, _, _ = run(logits, states, method)
        for r, t in enumerate(ids.tolist()):
            assert float(logits[r, t]) >= cutoffs[r]
            seen[r].add(t)
    assert len(seen[0]) > 10


def test_top_k_at_or_above_vocab_is_off() -> None:
    md = build_sampling_metadata([state(SamplingParams(top_k=10))], 10)
    assert md.top_k is None


# --- penalties, bias, min_tokens -------------------------------------------


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5, 1.0]])
    sp = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    st = state(sp, prompt=[1, 2], output=[2, 3, 3])
    got = processed_logits(logits, [st])
    # Seen (prompt or output): 1, 2, 3. Repetition: positive / 2, negative * 2.
    # Output counts: 2 -> 1, 3 -> 2; frequency 0.5 * count, presence 0.25.
    expected = torch.tensor(
        [
            [
                2.0,  # unseen
                -1.0 * 2.0,  # prompt only: repetition, no freq/presence
                3.0 / 2.0 - 0.5 * 1 - 0.25,
                -2.0 * 2.0 - 0.5 * 2 - 0.25,
                0.5,
                1.0,
            ]
        ]
    )
    assert torch.allclose(got, expected)


def test_penalties_touch_only_their_rows() -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 50, generator=g)
    states = [
        state(SamplingParams(temperature=0.0), prompt=[1, 2], output=[3]),
        state(SamplingParams(temperature=0.0, frequency_penalty=1.0), prompt=[4], output=[5, 5]),
        state(SamplingParams(temperature=0.0), output=[6]),
    ]
    md = build_sampling_metadata(states, 50)
    assert md.repetition_rows is None  # no repetition penalty anywhere
    assert md.output_penalty_rows is not None
    assert md.output_penalty_rows.tolist() == [1, 1]  # one entry per occurrence
    assert md.output_penalty_token_ids is not None
    assert md.output_penalty_token_ids.tolist() == [5, 5]
    assert md.presence_penalties is None
    got = processed_logits(logits, states)
    expected = logits.clone()
    expected[1, 5] -= 2.0
    assert torch.equal(got, expected)


def test_penalties_sparse_pairs_and_out_of_vocab_prompt_ids() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]])
    states = [
        # Prompt id 99 is outside the vocabulary: ignored, not an error.
        state(SamplingParams(repetition_penalty=4.0, presence_penalty=1.0), [0, 99, 0], [1, 1]),
        state(SamplingParams(frequency_penalty=0.5), [3], [2, 2, 2, 0]),
    ]
    md = build_sampling_metadata(states, 4)
    assert md.repetition_rows is not None and md.repetition_token_ids is not None
    assert set(zip(md.repetition_rows.tolist(), md.repetition_token_ids.tolist())) == {
        (0, 0),
        (0, 1),
    }
    got = processed_logits(logits, states)
    expected = torch.tensor([[0.25, -4.0 - 1.0, 2.0, 4.0], [1.0 - 0.5, 1.0, 1.0 - 1.5, 1.0]])
    assert torch.allclose(got, expected)


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    st = state(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0])
    assert int(run(logits, [st])[0]) == 1  # 5 / 2 = 2.5 < 4


def test_logit_bias_adds_and_ignores_out_of_vocab() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    states = [
        state(SamplingParams(temperature=0.0, logit_bias={0: 5.0, 2: -1.5, 99: 10.0})),
        state(SamplingParams(temperature=0.0)),
    ]
    got = processed_logits(logits, states)
    assert torch.equal(got, torch.tensor([[6.0, 2.0, 1.5, 0.0], [0.0, 0.0, 0.0, 1.0]]))
    assert run(logits, states)[0].tolist() == [0, 3]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    eos, stop = 3, 5
    logits = torch.zeros(1, 8)
    logits[0, eos] = 10.0
    logits[0, stop] = 9.0
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])
    sp.all_stop_token_ids.add(eos)  # what the processor does (ignore_eos=False)
    before = processed_logits(logits, [state(sp, output=[1], eos=eos)])
    assert before[0, eos] == NEG_INF and before[0, stop] == NEG_INF
    assert torch.equal(before[0, [0, 1, 2, 4, 6, 7]], logits[0, [0, 1, 2, 4, 6, 7]])
    assert int(run(logits, [state(sp, output=[1], eos=eos)])[0]) not in (eos, stop)
    # Reached: nothing is masked any more.
    after = processed_logits(logits, [state(sp, output=[1, 2], eos=eos)])
    assert torch.equal(after, logits)
    assert int(run(logits, [state(sp, output=[1, 2], eos=eos)])[0]) == eos


def test_min_tokens_uses_eos_id_when_processor_did_not() -> None:
    eos = 2
    logits = torch.zeros(1, 4)
    logits[0, eos] = 1.0
    sp = SamplingParams(temperature=0.0, min_tokens=1)
    got = processed_logits(logits, [state(sp, eos=eos)])
    assert got[0, eos] == NEG_INF


def test_ignore_eos_leaves_eos_unmasked_but_masks_stop_ids() -> None:
    eos, stop = 2, 0
    logits = torch.zeros(1, 4)
    logits[0, eos] = 1.0
    sp = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[stop])
    got = processed_logits(logits, [state(sp, eos=eos)])
    assert got[0, eos] == 1.0
    assert got[0, stop] == NEG_INF
    assert int(run(logits, [state(sp, eos=eos)])[0]) == eos


# --- logprobs ----------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_logprobs_are_raw_log_softmax_with_ranks(method: str) -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 300, generator=g)
    states = [
        state(SamplingParams(temperature=0.0, logprobs=5, logit_bias={7: 50.0})),
        state(SamplingParams(temperature=0.8, logprobs=2, repetition_penalty=1.5), prompt=[1]),
        state(SamplingParams(temperature=1.0)),  # wants none: gets a filler row
        state(SamplingParams(temperature=1.3, top_k=40, logprobs=0), seed=3),
    ]
    torch.manual_seed(0)
    ids, md, lp = run(logits, states, method)
    assert md.max_num_logprobs == 5
    assert lp is not None
    ref = torch.log_softmax(logits, -1)
    assert lp.logprob_token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6)
    assert torch.equal(lp.logprob_token_ids[:, 0], ids)
    assert int(ids[0]) == 7  # the bias decides the token, not the logprobs
    assert md.logprob_rows is not None and md.logprob_rows.tolist() == [0, 1, 3]
    # Row 2 did not ask: filler only, recognisable by rank 0.
    assert int(lp.ranks[2]) == 0 and bool(lp.logprobs[2].isnan().all())
    assert lp.logprob_token_ids[2].tolist() == [int(ids[2])] * 6
    for r in (0, 1, 3):
        tok = int(ids[r])
        assert float(lp.logprobs[r, 0]) == pytest.approx(float(ref[r, tok]), abs=1e-6)
        assert int(lp.ranks[r]) == 1 + int((ref[r] > ref[r, tok]).sum())
        top = ref[r].topk(5)
        assert lp.logprob_token_ids[r, 1:].tolist() == top.indices.tolist()
        assert torch.allclose(lp.logprobs[r, 1:], top.values)
    assert int(lp.ranks[0]) > 1  # token 7 is not the raw argmax


def test_logprobs_when_every_row_asks() -> None:
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 50, generator=g)
    states = [state(SamplingParams(temperature=0.0, logprobs=n)) for n in (1, 3, 2)]
    ids, md, lp = run(logits, states)
    assert md.logprob_rows is None and lp is not None
    ref = torch.log_softmax(logits, -1)
    assert lp.ranks.tolist() == [1, 1, 1]
    assert torch.allclose(lp.logprobs[:, 0], ref.gather(1, ids.unsqueeze(1)).squeeze(1))
    assert torch.equal(lp.logprob_token_ids[:, 1:], ref.topk(3).indices)


def test_reused_sampler_outputs_do_not_alias_scratch() -> None:
    """One Sampler reuses its scratch buffers across steps; what it returned
    earlier must not change when it runs again on other shapes."""
    g = torch.Generator().manual_seed(17)
    sampler = Sampler()
    first_logits = torch.randn(3, 400, generator=g)
    first_states = [
        state(SamplingParams(temperature=0.0, logprobs=2)),
        state(SamplingParams(temperature=0.9, min_p=0.05, top_p=0.9), seed=1),
        state(SamplingParams(temperature=0.0)),
    ]
    first = sampler(first_logits.clone(), build_sampling_metadata(first_states, 400))
    assert first.logprobs is not None
    snapshot = (
        first.sampled_token_ids.clone(),
        first.logprobs.logprob_token_ids.clone(),
        first.logprobs.logprobs.clone(),
        first.logprobs.ranks.clone(),
    )
    for b, v in [(5, 900), (2, 400), (4, 300)]:
        states = [
            state(SamplingParams(temperature=0.7, logprobs=3, min_p=0.1), seed=i) for i in range(b)
        ]
        states[0] = state(SamplingParams(temperature=0.0, logprobs=1))
        sampler(torch.randn(b, v, generator=g), build_sampling_metadata(states, v))
    assert torch.equal(first.sampled_token_ids, snapshot[0])
    assert torch.equal(first.logprobs.logprob_token_ids, snapshot[1])
    # Row 1 and 2 did not ask: NaN filler, which must stay NaN.
    torch.testing.assert_close(first.logprobs.logprobs, snapshot[2], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(first.logprobs.ranks, snapshot[3])


def test_logprobs_rank_one_for_greedy_and_zero_top() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    _, _, lp = run(logits, [state(SamplingParams(temperature=0.0, logprobs=0))])
    assert lp is not None
    assert lp.logprob_token_ids.tolist() == [[1]]
    assert lp.ranks.tolist() == [1]
    assert lp.logprobs[0, 0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))


# --- distribution ------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_frequencies(method: str, temperature: float) -> None:
    probs = torch.tensor([0.2, 0.3, 0.5])
    logits = probs.log().unsqueeze(0)
    st = state(SamplingParams(temperature=temperature, seed=77), seed=77)
    counts = Counter(int(run(logits, [st], method)[0]) for _ in range(2000))
    target = probs ** (1.0 / temperature)
    target = target / target.sum()
    for tok in range(3):
        assert abs(counts[tok] / 2000 - float(target[tok])) < 0.04, (tok, counts)


def test_exp_weights_proportional_to_softmax_with_exact_zeros() -> None:
    g = torch.Generator().manual_seed(13)
    x = torch.randn(4, 700, generator=g) * torch.tensor([[1.0], [10.0], [60.0], [200.0]])
    x[:, ::7] = NEG_INF
    w = exp_weights_(x.clone())
    ref = torch.softmax(x.double(), -1)
    assert bool((w[:, ::7] == 0).all())
    assert torch.equal(w.amax(-1), torch.ones(4))
    assert torch.allclose((w / w.sum(-1, keepdim=True)).double(), ref, atol=1e-7, rtol=1e-5)
    # Zeroed entries are exactly those negligible next to the best token.
    rel = x - x.amax(-1, keepdim=True)
    assert bool((w[rel < -87.0] == 0).all())
    assert bool((w[rel > -86.5] > 0).all())
    assert bool((rel < -87.0).any())  # the case is exercised


@pytest.mark.parametrize("method", METHODS)
def test_low_temperature_is_nearly_greedy(method: str) -> None:
    # T = 0.01 stretches the logits to thousands: nearly every weight
    # underflows, which must neither slow nor break the draw.
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(8, 4000, generator=g) * 5
    states = [state(SamplingParams(temperature=0.01), seed=i) for i in range(8)]
    ids, _, _ = run(logits, states, method)
    assert torch.equal(ids, logits.argmax(-1))


def test_categorical_inverse_cdf_edges() -> None:
    v = 1000  # several chunks plus a short tail
    w = torch.zeros(3, v)
    w[0, 0] = 1.0
    w[1, v - 1] = 2.0
    w[2, 300] = 1.0
    w[2, 900] = 1.0
    for u in [0.0, 0.25, 0.5, 0.999999, 1.0 - 2.0**-53]:
        got = categorical_inverse_cdf(w, torch.full((3,), u, dtype=torch.float64))
        assert got[0] == 0 and got[1] == v - 1
        assert int(got[2]) == (300 if u < 0.5 else 900)


def test_candidate_sampling_skips_zero_weight_columns() -> None:
    # Sorted candidates where min_p already sent the kept tail to -inf.
    group = _Candidates(
        rows=None,
        values=torch.tensor([[2.0, 1.0, NEG_INF, NEG_INF]]),
        token_ids=torch.tensor([[7, 3, 9, 4]]),
        n_keep=torch.tensor([4]),
    )
    for u, tok in [(0.0, 7), (0.5, 7), (0.9, 3), (1.0 - 2.0**-53, 3), (1.0, 3)]:
        assert group.sample(torch.tensor([u], dtype=torch.float64)).tolist() == [tok]


def test_categorical_inverse_cdf_matches_flat_search() -> None:
    g = torch.Generator().manual_seed(10)
    w = torch.rand(6, 3333, generator=g) ** 4
    u = torch.rand(6, dtype=torch.float64, generator=g)
    cdf = w.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    got = categorical_inverse_cdf(w, u)
    # Chunked and flat summation may round differently right at a boundary.
    assert (got - ref).abs().max() <= 1


def test_rejects_mismatched_shapes() -> None:
    md = build_sampling_metadata([state(SamplingParams())], 10)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, 12), md)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), md)
    with pytest.raises(ValueError):
        Sampler("bogus")  # type: ignore[arg-type]


def test_non_float32_logits_are_accepted() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]], dtype=torch.bfloat16)
    md = build_sampling_metadata([state(SamplingParams(temperature=0.0))], 3)
    assert int(Sampler()(logits, md).sampled_token_ids[0]) == 1



@pytest.mark.parametrize("num_top", [0, 2])
def test_prompt_logprobs_stay_on_the_logits_device(num_top: int) -> None:
    """The prompt's target ids are made where the logits are: on a GPU a
    host index tensor fails the gather (the meta device stands in here,
    as it keeps every tensor's device without computing)."""
    out = prompt_logprobs_tensors(torch.zeros(3, 10, device="meta"), [1, 2, 3], num_top)
    assert {t.device.type for t in (out.logprob_token_ids, out.logprobs, out.ranks)} == {"meta"}
    assert tuple(out.logprob_token_ids.shape) == (3, num_top + 1)
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 2.0, 1.0]])
    lists = prompt_logprobs_tensors(logits, [1, 1], num_top).tolists()
    expected = torch.log_softmax(logits, -1)
    assert lists.logprob_token_ids == [[1, 2, 1][: num_top + 1], [1, 0, 1][: num_top + 1]]
    assert lists.logprobs[0][0] == pytest.approx(expected[0, 1].item())
    assert lists.ranks == [2, 2]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("top", [{}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_extreme_repetition_penalties_sample_a_seen_or_unseen_token_not_fail(method: str, top: dict) -> None:
    """A repetition penalty of ~0 divides a seen token's positive logit past
    float32's range (+inf, and inf - inf = NaN in the sampling after), one
    of ~inf multiplies a zero logit into NaN: a fuzzed request's penalty
    ended the engine this way. The seen tokens with positive logits win
    outright at ~0 (as their logits tend to infinity), and a huge penalty
    leaves a zero logit at zero."""
    logits = torch.tensor([[2.0, 3.0, 0.0, 1.0, -1.0, 0.5]] * 2)
    tiny = state(SamplingParams(temperature=0.7, repetition_penalty=1e-300, **top), prompt=[0, 1, 4], seed=1)
    huge = state(SamplingParams(temperature=0.7, repetition_penalty=1e300, **top), prompt=[2, 4], seed=2)
    for _ in range(20):
        ids, _, _ = run(logits, [tiny, huge], method)
        assert int(ids[0]) in (0, 1)  # the two seen positive logits, both pushed to the top of the range
        assert 0 <= int(ids[1]) < 6 and int(ids[1]) != 4  # -1 * ~inf is masked; 0 * ~inf stays 0


def test_a_candidate_row_without_a_finite_top_takes_its_top_candidate(caplog: pytest.LogCaptureFixture) -> None:
    """Rows whose candidates are all -inf or NaN (CI's fuzzed requests
    reached one; how is not found yet) sample their first candidate; before,
    the index was -1 and the step failed, ending the engine."""
    nan, inf = float("nan"), float("inf")
    groups = _Candidates(
        rows=None,
        values=torch.tensor([[NEG_INF, NEG_INF], [nan, 1.0], [inf, inf], [2.0, 1.0]]),
        token_ids=torch.tensor([[7, 8], [5, 6], [3, 4], [1, 2]]),
        n_keep=torch.tensor([2, 2, 2, 1]),
    )
    assert groups.sample(torch.tensor([0.5, 0.5, 0.5, 0.99], dtype=torch.float64)).tolist() == [7, 5, 3, 1]
    assert "without a finite top candidate" in caplog.text  # said, not silent
