"""Batched sampling inputs for one model-runner step.

`build_sampling_metadata` turns the per-request sampling state the runner keeps
into the handful of tensors the `Sampler` needs. It is on the per-step hot
path, so it makes one cheap Python pass over the batch to classify rows and
only then creates tensors for the features some row actually uses: an
all-greedy batch with no penalties, biases, min_tokens or logprobs creates no
tensor at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Protocol, Sequence

import numpy as np
import torch

from rayvllm.messages.sampling_params import SamplingParams


class SamplingState(Protocol):
    """What the builder reads from one request in the batch.

    The model runner's per-request state (e.g. `CachedRequestState`) satisfies
    this structurally. `output_token_ids` holds the tokens generated so far
    (it grows by one per step). `generator` is set iff the request has a seed
    and is not greedy; only the sampler draws from it, a fixed amount per
    step the request samples (`Sampler.advance_generator` replays that on
    resumption). It must live on the logits' device.
    """

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def generator(self) -> torch.Generator | None: ...

    @property
    def eos_token_id(self) -> int | None: ...


@dataclass
class RequestSamplingState:
    """A plain `SamplingState`, for tests and callers without a runner state."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    eos_token_id: int | None = None


@dataclass
class SamplingMetadata:
    """Sampling inputs for a batch of `num_reqs` rows over `vocab_size` logits.

    Invariants:
    - `vocab_size` is the logits' last dimension (the model's, possibly padded,
      vocabulary), and every token id stored here is in `[0, vocab_size)`.
    - Exactly one of `all_greedy` / `all_random` / neither holds. "Random" rows
      are those with temperature > 0; their positions in the batch are
      `random_rows` (None when `all_random`, meaning every row, and unused
      when `all_greedy`). `temperature`, `min_p` and the truncation fields are
      indexed by position *within the random rows*, not by batch row.
    - Each per-feature field is None when no row uses the feature, which is
      how the sampler skips the work.
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool

    # --- random rows -------------------------------------------------------
    random_rows: torch.Tensor | None = None  # [R] int64 batch rows; None = all rows
    # [R] float32, > 0; None when every random row has temperature 1.0.
    temperature: torch.Tensor | None = None
    # [R] float32 in [0, 1]; None when no random row sets min_p.
    min_p: torch.Tensor | None = None
    # Top-k / top-p truncation, restricted to the random rows that use either.
    # `trunc_rows` indexes into the random rows (None = all of them); `top_k`
    # is 0 where a row has no top-k (or top_k >= vocab_size), `top_p` is 1.0
    # where a row has no top-p. `max_top_k` is the largest top_k among them
    # (0 if none); `top_p_without_top_k` says some row needs top-p over the
    # whole vocabulary, which may force a full sort.
    trunc_rows: torch.Tensor | None = None  # [T] int64
    # The other random rows (set iff `trunc_rows` is), which sample over the
    # whole vocabulary.
    untrunc_rows: torch.Tensor | None = None  # [R - T] int64
    top_k: torch.Tensor | None = None  # [T] int64
    top_p: torch.Tensor | None = None  # [T] float32
    max_top_k: int = 0
    top_p_without_top_k: bool = False
    # Seeded rows: position within the random rows -> that request's generator.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    # --- logprobs ----------------------------------------------------------
    # Largest `logprobs` over rows that asked; None when no row asked.
    max_num_logprobs: int | None = None
    # [L] int64 batch rows that asked for logprobs; None = every row asked.
    logprob_rows: torch.Tensor | None = None

    # --- logit bias (sparse) -----------------------------------------------
    logit_bias_rows: torch.Tensor | None = None  # [NB] int64
    logit_bias_token_ids: torch.Tensor | None = None  # [NB] int64
    logit_bias_values: torch.Tensor | None = None  # [NB] float32

    # --- min_tokens: (row, stop token) pairs to force to -inf this step ------
    min_tokens_rows: torch.Tensor | None = None  # [NM] int64
    min_tokens_token_ids: torch.Tensor | None = None  # [NM] int64

    # --- penalties, sparse: one entry per token occurrence, never [B, V] -----
    # Repetition: every token of the prompt and output of a row with
    # repetition_penalty != 1, paired with that row's penalty. Pairs may
    # repeat; the sampler's gather-then-put makes repeats harmless.
    repetition_rows: torch.Tensor | None = None  # [NR] int64
    repetition_token_ids: torch.Tensor | None = None  # [NR] int64
    repetition_penalties: torch.Tensor | None = None  # [NR] float32
    # Frequency / presence: every output token occurrence of a row with
    # either penalty, with that row's values (None when all are 0).
    output_penalty_rows: torch.Tensor | None = None  # [NO] int64
    output_penalty_token_ids: torch.Tensor | None = None  # [NO] int64
    frequency_penalties: torch.Tensor | None = None  # [NO] float32
    presence_penalties: torch.Tensor | None = None  # [NO] float32

    @property
    def needs_processing(self) -> bool:
        """True when some logits must change before argmax/sampling."""
        return (
            self.logit_bias_rows is not None
            or self.min_tokens_rows is not None
            or self.repetition_rows is not None
            or self.output_penalty_rows is not None
        )


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _float(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _flat_pairs(
    rows: list[int], token_lists: list[list[int]], vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token, list index) for every token of every list, int64.

    Goes through numpy: torch.tensor on a Python list costs ~0.4 us per
    element, np.fromiter a seventh of that. Tokens outside the model's
    vocabulary (only a client's prompt could hold one) cannot influence a
    logit, so they are dropped rather than allowed to fault an index.
    """
    lengths = [len(t) for t in token_lists]
    total = sum(lengths)
    tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
    which = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    ok = (tokens >= 0) & (tokens < vocab_size)
    if not ok.all():
        tokens, which = tokens[ok], which[ok]
    return np.asarray(rows, dtype=np.int64)[which], tokens, which


def build_sampling_metadata(
    states: Sequence[SamplingState], vocab_size: int
) -> SamplingMetadata:
    """Batch the sampling inputs of `states` (row i = states[i]).

    `vocab_size` must be the logits' last dimension, which may exceed the
    tokenizer's vocabulary. Reads `output_token_ids` as they are now, so call
    it after appending the previous step's tokens.
    """
    num_reqs = len(states)
    random_rows: list[int] = []
    penalty_rows: list[int] = []
    bias_rows: list[int] = []
    min_tok_rows: list[int] = []
    max_num_logprobs: int | None = None
    logprob_rows: list[int] = []

    # One pass of attribute checks classifies every row; everything after it
    # is skipped for features no row uses.
    for i, state in enumerate(states):
        sp = state.sampling_params
        if sp.temperature != 0.0:
            random_rows.append(i)
        if (
            sp.repetition_penalty != 1.0
            or sp.frequency_penalty != 0.0
            or sp.presence_penalty != 0.0
        ):
            penalty_rows.append(i)
        if sp.logit_bias:
            bias_rows.append(i)
        if sp.min_tokens and len(state.output_token_ids) < sp.min_tokens:
            min_tok_rows.append(i)
        if sp.logprobs is not None:
            logprob_rows.append(i)
            if max_num_logprobs is None or sp.logprobs > max_num_logprobs:
                max_num_logprobs = sp.logprobs

    num_random = len(random_rows)
    md = SamplingMetadata(
        num_reqs=num_reqs,
        vocab_size=vocab_size,
        all_greedy=num_random == 0,
        all_random=num_random == num_reqs and num_reqs > 0,
        max_num_logprobs=max_num_logprobs,
    )
    if logprob_rows and len(logprob_rows) != num_reqs:
        md.logprob_rows = _long(logprob_rows)
    if num_random:
        _fill_random(md, states, random_rows, vocab_size)
    if bias_rows:
        _fill_logit_bias(md, states, bias_rows, vocab_size)
    if min_tok_rows:
        _fill_min_tokens(md, states, min_tok_rows, vocab_size)
    if penalty_rows:
        _fill_penalties(md, states, penalty_rows, vocab_size)
    return md


def _fill_random(
    md: SamplingMetadata,
    states: Sequence[SamplingState],
    random_rows: list[int],
    vocab_size: int,
) -> None:
    if not md.all_random:
        md.random_rows = _long(random_rows)
    temps: list[float] = []
    min_ps: list[float] = []
    trunc_pos: list[int] = []
    top_ks: list[int] = []
    top_ps: list[float] = []
    for pos, row in enumerate(random_rows):
        state = states[row]
        sp = state.sampling_params
        temps.append(sp.temperature)
        min_ps.append(sp.min_p)
        # top_k >= vocab keeps everything, so it is "off" rather than a
        # reason to run topk over the full vocabulary.
        k = sp.top_k if 0 < sp.top_k < vocab_size else 0
        if k or sp.top_p < 1.0:
            trunc_pos.append(pos)
            top_ks.append(k)
            top_ps.append(sp.top_p)
        if state.generator is not None:
            md.generators[pos] = state.generator
    if any(t != 1.0 for t in temps):
        md.temperature = _float(temps)
    if any(m > 0.0 for m in min_ps):
        md.min_p = _float(min_ps)
    if trunc_pos:
        if len(trunc_pos) != len(random_rows):
            md.trunc_rows = _long(trunc_pos)
            kept = set(trunc_pos)
            md.untrunc_rows = _long([p for p in range(len(random_rows)) if p not in kept])
        md.top_k = _long(top_ks)
        md.max_top_k = max(top_ks)
        if any(p < 1.0 for p in top_ps):
            md.top_p = _float(top_ps)
            md.top_p_without_top_k = any(
                p < 1.0 and k == 0 for p, k in zip(top_ps, top_ks)
            )


def _fill_logit_bias(
    md: SamplingMetadata,
    states: Sequence[SamplingState],
    bias_rows: list[int],
    vocab_size: int,
) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row in bias_rows:
        bias = states[row].sampling_params.logit_bias
        assert bias is not None
        for tok, val in bias.items():
            if 0 <= tok < vocab_size:
                rows.append(row)
                tokens.append(tok)
                values.append(val)
    if rows:
        md.logit_bias_rows = _long(rows)
        md.logit_bias_token_ids = _long(tokens)
        md.logit_bias_values = _float(values)


def stop_token_ids_for_min_tokens(state: SamplingState) -> set[int]:
    """Token ids that min_tokens must suppress for `state`.

    `all_stop_token_ids` already holds EOS when the processor filled it
    (unless ignore_eos); adding `eos_token_id` here keeps the rule right for
    params that never went through the processor, and is a no-op otherwise.
    """
    sp = state.sampling_params
    ids = set(sp.all_stop_token_ids)
    ids.update(sp.stop_token_ids or ())
    if state.eos_token_id is not None and not sp.ignore_eos:
        ids.add(state.eos_token_id)
    return ids


def _fill_min_tokens(
    md: SamplingMetadata,
    states: Sequence[SamplingState],
    min_tok_rows: list[int],
    vocab_size: int,
) -> None:
    rows: list[int] = []
    tokens: list[int] = []
    for row in min_tok_rows:
        for tok in stop_token_ids_for_min_tokens(states[row]):
            if 0 <= tok < vocab_size:
                rows.append(row)
                tokens.append(tok)
    if rows:
        md.min_tokens_rows = _long(rows)
        md.min_tokens_token_ids = _long(tokens)


def _fill_penalties(
    md: SamplingMetadata,
    states: Sequence[SamplingState],
    penalty_rows: list[int],
    vocab_size: int,
) -> None:
    """Sparse penalty inputs, O(tokens of the penalised rows), never O(V).

    Dense [P, V] masks would cost a fresh multi-megabyte allocation (page
    faults included) every step, and deduplicating pairs (np.unique) costs
    more than letting the sampler handle repeats.
    """
    rep_rows = [r for r in penalty_rows if states[r].sampling_params.repetition_penalty != 1.0]
    if rep_rows:
        lists = [states[r].prompt_token_ids for r in rep_rows]
        lists += [states[r].output_token_ids for r in rep_rows]
        rows, tokens, which = _flat_pairs(rep_rows + rep_rows, lists, vocab_size)
        if tokens.size:
            pen = np.array(
                [states[r].sampling_params.repetition_penalty for r in rep_rows] * 2,
                dtype=np.float32,
            )
            md.repetition_rows = torch.from_numpy(rows)
            md.repetition_token_ids = torch.from_numpy(tokens)
            md.repetition_penalties = torch.from_numpy(pen[which])

    out_rows = [
        r
        for r in penalty_rows
        if states[r].sampling_params.frequency_penalty != 0.0
        or states[r].sampling_params.presence_penalty != 0.0
    ]
    if out_rows:
        rows, tokens, which = _flat_pairs(
            out_rows, [states[r].output_token_ids for r in out_rows], vocab_size
        )
        if tokens.size:
            md.output_penalty_rows = torch.from_numpy(rows)
            md.output_penalty_token_ids = torch.from_numpy(tokens)
            freq = [states[r].sampling_params.frequency_penalty for r in out_rows]
            pres = [states[r].sampling_params.presence_penalty for r in out_rows]
            if any(freq):
                md.frequency_penalties = torch.from_numpy(np.array(freq, dtype=np.float32)[which])
            if any(pres):
                md.presence_penalties = torch.from_numpy(np.array(pres, dtype=np.float32)[which])
