"""Token sampler with vLLM v1 semantics, tuned for the per-step hot path.

Order of operations (as in vLLM v1; a grammar's bitmask is applied to the
logits before the sampler, by the structured-output extension, so logprobs
see it too):
  1. logprobs, if any row asked, from the raw logits (log_softmax);
  2. logit bias, min_tokens (stop ids -> -inf), penalties
     (repetition, frequency, presence);
  3. greedy rows: argmax. Random rows: temperature, min_p, top-k/top-p,
     then one categorical draw per row;
  4. gather the sampled token's logprob and rank plus the top-N.

The categorical draw takes one uniform per row on CPU (inverse CDF) and one
exponential per vocabulary entry on CUDA (the exponential race vLLM uses,
which avoids a device sync). Both sample exactly the target distribution; the
CPU path exists because drawing V exponentials costs far more than the rest
of the step on a CPU (measured ~19 ms per 152k-vocab row, single thread). On
the CPU path, rows with top-k/top-p draw among their sorted candidates
instead of masking and re-scanning the whole vocabulary.

Seeded rows draw from their own generator, the same amount every step
whatever the batch, and every computation feeding their token is row-local,
so a seeded request's tokens do not depend on the other rows of the batch or
on its own row index.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from rayvllm.messages.engine_types import LogprobsTensors
from rayvllm.model_executor.sampling_metadata import SamplingMetadata

logger = logging.getLogger(__name__)

SamplingMethod = Literal["auto", "inverse_cdf", "exponential_race"]

# Chunk width for the two-level argmax and inverse-CDF search: a row of V
# logits is viewed as V/_CHUNK chunks, reduced with vectorised kernels, and
# only one chunk per row is scanned element by element.
_CHUNK = 256
# Below this many logits in the batch, a plain argmax beats the two-level one.
_TWO_LEVEL_MIN_NUMEL = 1 << 16
# top-p rows without top-k first look for their nucleus among this many top
# tokens; rows whose nucleus is wider retry with _TOP_P_GROWTH times more,
# and a full sort only once the candidates would exceed a quarter of V.
_TOP_P_PREFILTER = 1024
_TOP_P_GROWTH = 8
# Chunk width of the two-level topk; it pays off while k chunks of this width
# are at most a quarter of the row.
_TOPK_CHUNK = 64


# exp() of anything below -87.3 is subnormal or 0 in float32, and torch's CPU
# exp takes a slow path there (measured 20-400x slower, -inf included). Weights
# are computed relative to the row max with inputs floored at _EXP_FLOOR, then
# anything at the floor is zeroed: tokens under e^-86.8 of the best one (and
# every masked token) get exactly 0, the rest their exact exp.
_EXP_FLOOR = -87.0
_WEIGHT_ZERO_BELOW = 2e-38


def exp_weights_(x: torch.Tensor) -> torch.Tensor:
    """In place: x <- exp(x - rowmax(x)), entries below e^-86.8 (and -inf)
    set to exactly 0. Proportional to softmax(x) row by row; each row's max
    entry is 1. Requires every row to have a finite max. Returns x."""
    x.sub_(x.amax(-1, keepdim=True))
    x.clamp_(min=_EXP_FLOOR)
    x.exp_()
    return torch.threshold_(x, _WEIGHT_ZERO_BELOW, 0.0)


@dataclass
class SamplerOutput:
    """Invariant: `sampled_token_ids[i]` is row i's token, in [0, V).

    `logprobs` is None unless some row asked; then it has one row per batch
    row: column 0 the sampled token, columns 1..N the top-N over the raw
    logits, with N = the batch's largest `logprobs` request (rows that asked
    for fewer trim the extra columns). Rows that did not ask hold filler:
    the sampled id in every column, NaN logprobs, rank 0."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def _chunk_view(x: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """[B, n_chunks, _CHUNK] view of the first n_chunks * _CHUNK columns of
    a row-major x, without the copy reshape would make of a column slice."""
    return x.as_strided((x.shape[0], n_chunks, _CHUNK), (x.stride(0), _CHUNK, 1))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of a 2-D tensor, identical to `x.argmax(-1)`.

    Ties resolve to the first index, like torch.argmax (and so like the HF
    greedy oracle). torch's CPU argmax is not vectorised; a chunked amax
    (vectorised) finds the chunk holding the first maximum, then argmax runs
    over that chunk alone, which is several times faster on big batches.
    """
    b, v = x.shape
    if (
        x.device.type != "cpu"
        or b * v < _TWO_LEVEL_MIN_NUMEL
        or v < 2 * _CHUNK
        or x.stride(1) != 1
    ):
        return x.argmax(-1)
    n_chunks = v // _CHUNK
    main = n_chunks * _CHUNK
    chunk_max = _chunk_view(x, n_chunks).amax(-1)
    if main < v:
        chunk_max = torch.cat([chunk_max, x[:, main:].amax(-1, keepdim=True)], 1)
    chunk = chunk_max.argmax(-1)
    # The tail chunk may be short: clamping repeats index v-1, and since
    # argmax keeps the first occurrence the repeats cannot change the answer.
    idx = (chunk.unsqueeze(1) * _CHUNK + torch.arange(_CHUNK)).clamp_(max=v - 1)
    within = x.gather(1, idx).argmax(-1, keepdim=True)
    return idx.gather(1, within).squeeze(1)


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k of a 2-D tensor, sorted descending: (values, indices).

    Same values as `x.topk(k, -1)`; among tied values the indices chosen may
    differ. torch's CPU topk partially sorts the whole row (~6 ns per
    element); for small k, the k chunks with the largest maxima provably
    hold the top k (any other element is <= its chunk's max <= the k-th
    largest chunk max <= the k-th largest element), so topk runs on those
    k * _TOPK_CHUNK elements after one vectorised chunked amax.
    """
    b, v = x.shape
    n_chunks = v // _TOPK_CHUNK
    if (
        x.device.type != "cpu"
        or x.stride(1) != 1
        or k * _TOPK_CHUNK * 4 > v
        or k > n_chunks
    ):
        return x.topk(k, dim=-1)
    main = n_chunks * _TOPK_CHUNK
    chunk_max = x.as_strided((b, n_chunks, _TOPK_CHUNK), (x.stride(0), _TOPK_CHUNK, 1)).amax(-1)
    best = chunk_max.topk(k, dim=-1, sorted=False).indices
    cols = (best.unsqueeze(-1) * _TOPK_CHUNK + torch.arange(_TOPK_CHUNK)).reshape(b, -1)
    if main < v:
        # The short tail chunk is not in chunk_max; always keep it.
        cols = torch.cat([cols, torch.arange(main, v).expand(b, -1)], 1)
    vals, j = x.gather(1, cols).topk(k, dim=-1)
    return vals, cols.gather(1, j)


def _last_positive_index(w: torch.Tensor) -> torch.Tensor:
    """Per row, the last column where w > 0 (0 if none). w: [R, L]."""
    cols = torch.arange(1, w.shape[1] + 1, device=w.device)
    return ((w > 0) * cols).argmax(-1).sub_(1).clamp_(min=0)


def categorical_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one index per row with probability proportional to `weights`.

    weights: [R, V], non-negative, each row with a positive sum; u: [R]
    float64 uniforms in [0, 1). Returns the first index whose cumulative
    weight exceeds u * total, so an index with zero weight is never chosen
    (its cumulative weight equals its predecessor's).

    Two levels keep the serial cumsum short: per-chunk sums (vectorised),
    a search over the chunks' cumulative sums, then a cumsum over one chunk.
    Float rounding can push the target past the last positive entry of the
    chosen chunk or of the row; those cases are snapped back to it.
    """
    weights = weights.contiguous()
    r, v = weights.shape
    n_full = v // _CHUNK
    main = n_full * _CHUNK
    sums = [_chunk_view(weights, n_full).sum(-1)] if n_full else []
    if main < v:
        sums.append(weights[:, main:].sum(-1, keepdim=True))
    chunk_sums = torch.cat(sums, 1).double() if len(sums) > 1 else sums[0].double()
    n_chunks = chunk_sums.shape[1]
    chunk_cdf = chunk_sums.cumsum(-1)
    target = u.to(torch.float64) * chunk_cdf[:, -1]
    chunk = torch.searchsorted(chunk_cdf, target.unsqueeze(1), right=True).squeeze(1)
    chunk.clamp_(max=n_chunks - 1)
    empty = chunk_sums.gather(1, chunk.unsqueeze(1)).squeeze(1) <= 0
    if bool(empty.any()):
        chunk = torch.where(empty, _last_positive_index(chunk_sums), chunk)
    # Mass of the chunks before the chosen one: exactly what the search
    # compared against, so target - before is never negative.
    before_all = torch.cat([torch.zeros_like(chunk_cdf[:, :1]), chunk_cdf[:, :-1]], 1)
    before = before_all.gather(1, chunk.unsqueeze(1)).squeeze(1)
    offsets = torch.arange(_CHUNK, device=weights.device)
    idx = chunk.unsqueeze(1) * _CHUNK + offsets
    valid = idx < v
    idx.clamp_(max=v - 1)
    # Clamped duplicates of the last column would add its weight again.
    w = weights.gather(1, idx).double().masked_fill_(~valid, 0.0)
    within_cdf = w.cumsum(-1)
    j = torch.searchsorted(within_cdf, (target - before).unsqueeze(1), right=True).squeeze(1)
    j.clamp_(max=_CHUNK - 1)
    bad = w.gather(1, j.unsqueeze(1)).squeeze(1) <= 0
    if bool(bad.any()):
        j = torch.where(bad, _last_positive_index(w), j)
    return idx.gather(1, j.unsqueeze(1)).squeeze(1)


class Scratch:
    """Reusable buffers for per-step [rows, V] temporaries.

    glibc serves allocations above its mmap threshold (at most 32 MiB) with
    fresh pages, so a new 256 x 152k float tensor pays ~10k page faults each
    step (measured: log_softmax 58 ms fresh vs 15 ms into a reused buffer).
    Each named buffer grows to the largest size asked for and is reused;
    a returned view is valid until the next request for the same name.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(tuple(shape))

    def rows(self, name: str, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x.index_select(0, index), written into the named buffer."""
        out = self.get(name, (index.shape[0], x.shape[1]), x.dtype, x.device)
        return torch.index_select(x, 0, index, out=out)


class Sampler:
    """Samples one token per row of a [B, V] logits batch.

    The sampler may modify `logits` in place (bias, penalties, masking,
    temperature); callers must not reuse the tensor afterwards. Apart from
    its configuration it keeps only scratch buffers (see `Scratch`), so one
    instance serves every step; it is not meant to be called concurrently.
    """

    def __init__(self, method: SamplingMethod = "auto") -> None:
        """`method`: "inverse_cdf" (one uniform per row), "exponential_race"
        (vLLM's probs / Exponential(1) argmax), or "auto" = exponential race
        on CUDA, inverse CDF elsewhere."""
        if method not in ("auto", "inverse_cdf", "exponential_race"):
            raise ValueError(f"unknown sampling method {method!r}")
        self.method: SamplingMethod = method
        self.scratch = Scratch()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        if logits.dim() != 2 or logits.shape[0] != md.num_reqs:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match {md.num_reqs} requests"
            )
        if logits.shape[1] != md.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns but metadata was built for "
                f"vocab_size={md.vocab_size}"
            )
        if logits.dtype != torch.float32:
            logits = logits.float()

        # vLLM v1 returns logprobs of the raw model output, before any
        # processing; they go to their own buffer, so later in-place edits
        # of `logits` are safe. Only the rows that asked pay for them.
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            asked = logits
            if md.logprob_rows is not None:
                asked = self.scratch.rows("lp_in", logits, md.logprob_rows.to(logits.device))
            out = self.scratch.get("lp", asked.shape, asked.dtype, asked.device)
            raw_logprobs = torch.log_softmax(asked, dim=-1, out=out)
        if md.needs_processing:
            self._apply_logit_bias(logits, md)
            self._apply_min_tokens(logits, md)
            self._apply_penalties(logits, md)

        sampled = self._sample(logits, md)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._gather_logprobs(
                raw_logprobs, sampled, md.max_num_logprobs or 0, md.logprob_rows, self.scratch
            )
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    # -- step 2: logits processing ------------------------------------------

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, md: SamplingMetadata) -> None:
        if md.logit_bias_rows is None:
            return
        assert md.logit_bias_token_ids is not None and md.logit_bias_values is not None
        # (row, token) pairs are unique (they come from dicts), so a plain
        # index_put_ with accumulate is exact.
        logits.index_put_(
            (md.logit_bias_rows.to(logits.device), md.logit_bias_token_ids.to(logits.device)),
            md.logit_bias_values.to(logits.device),
            accumulate=True,
        )

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> None:
        if md.min_tokens_rows is None:
            return
        assert md.min_tokens_token_ids is not None
        logits[md.min_tokens_rows.to(logits.device), md.min_tokens_token_ids.to(logits.device)] = (
            float("-inf")
        )

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
        """Repetition, then frequency, then presence (vLLM order), touching
        only the (row, token) pairs the metadata lists.

        The pair lists may repeat a pair. Repetition and presence gather the
        old values, compute, then put: every repeat writes the same value, so
        each applies once per distinct pair. Frequency accumulates, so it
        applies once per occurrence, i.e. freq * count.
        """
        dev = logits.device
        if md.repetition_rows is not None:
            assert md.repetition_token_ids is not None and md.repetition_penalties is not None
            idx = (md.repetition_rows.to(dev), md.repetition_token_ids.to(dev))
            seen = logits[idx]
            # A penalty past float range (inf) would make 0 * inf = NaN of a zero logit.
            pen = md.repetition_penalties.to(dev).clamp(max=torch.finfo(logits.dtype).max)
            # HF/vLLM rule: a seen token moves toward "less likely" whatever
            # its sign, so positive logits shrink and negative ones grow.
            logits[idx] = torch.where(seen > 0, seen / pen, seen * pen)
        if md.output_penalty_rows is None:
            return
        assert md.output_penalty_token_ids is not None
        idx = (md.output_penalty_rows.to(dev), md.output_penalty_token_ids.to(dev))
        if md.frequency_penalties is not None:
            logits.index_put_(idx, md.frequency_penalties.to(dev).neg(), accumulate=True)
        if md.presence_penalties is not None:
            logits[idx] = logits[idx] - md.presence_penalties.to(dev)

    def advance_generator(
        self, generator: torch.Generator, num_steps: int, vocab_size: int
    ) -> None:
        """Consume from a seeded request's generator exactly what `num_steps`
        sampling steps of this sampler draw from it, so a request resumed
        after preemption (its generator rebuilt from the seed) continues the
        same random stream. Greedy requests draw nothing, so have nothing to
        skip.
        """
        if num_steps <= 0:
            return
        dev = generator.device
        if self._resolved_method(dev) == "inverse_cdf":
            # One float64 uniform per step; a batched draw of n consumes the
            # same stream as n single draws (checked in the tests).
            torch.rand(num_steps, dtype=torch.float64, generator=generator, device=dev)
            return
        scratch = torch.empty(vocab_size, device=dev)
        for _ in range(num_steps):
            scratch.exponential_(generator=generator)

    # -- step 3: sampling ---------------------------------------------------

    def _resolved_method(self, device: torch.device) -> SamplingMethod:
        if self.method != "auto":
            return self.method
        return "exponential_race" if device.type == "cuda" else "inverse_cdf"

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return argmax_rows(logits)
        dev = logits.device
        greedy = None if md.all_random else argmax_rows(logits)
        if md.all_random:
            work = logits
        else:
            assert md.random_rows is not None
            work = self.scratch.rows("work", logits, md.random_rows.to(dev))

        if md.temperature is not None:
            work.div_(md.temperature.to(dev).unsqueeze(1))
        if md.repetition_rows is not None:
            # A penalty near 0 divides a seen logit past float range, and the
            # temperature can again: +inf would turn into inf - inf = NaN in
            # the steps below. The largest finite value keeps the order.
            work.clamp_(max=torch.finfo(work.dtype).max)
        if md.min_p is not None:
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p);
            # the logit form needs no softmax. min_p = 0 gives -inf: no-op.
            threshold = work.amax(-1, keepdim=True) + md.min_p.to(dev).log().unsqueeze(1)
            mask = self.scratch.get("mask", work.shape, torch.bool, dev)
            work.masked_fill_(torch.lt(work, threshold, out=mask), float("-inf"))

        if self._resolved_method(dev) == "inverse_cdf":
            random_ids = self._sample_inverse_cdf(work, md)
        else:
            random_ids = self._sample_exponential_race(work, md)
        if greedy is None:
            return random_ids
        assert md.random_rows is not None
        return greedy.index_copy_(0, md.random_rows.to(dev), random_ids)

    def _candidates(
        self, work: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[_Candidates]]:
        """Top-k/top-p candidates of the truncated rows of `work`.

        Returns the truncated rows' positions in `work` (None = all rows),
        those rows of `work` (a scratch copy unless None), and the candidate
        groups, whose `rows` index into those positions."""
        assert md.top_k is not None
        dev = work.device
        rows = None if md.trunc_rows is None else md.trunc_rows.to(dev)
        sub = work if rows is None else self.scratch.rows("trunc", work, rows)
        groups = top_k_top_p_candidates(
            sub,
            md.top_k.to(dev),
            None if md.top_p is None else md.top_p.to(dev),
            md.max_top_k,
            md.top_p_without_top_k,
            scratch=self.scratch,
        )
        return rows, sub, groups

    def _sample_inverse_cdf(self, work: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Truncated rows draw among their sorted candidates, the others over
        the whole vocabulary; each row uses exactly one uniform, taken from
        its own generator when seeded, and its token depends only on its own
        logits and that uniform."""
        r = work.shape[0]
        dev = work.device
        u = torch.empty(r, dtype=torch.float64, device=dev)
        if len(md.generators) != r:
            u.uniform_()
        for pos, gen in md.generators.items():
            u[pos] = torch.rand((), dtype=torch.float64, generator=gen, device=gen.device)
        if md.top_k is None:
            return categorical_inverse_cdf(exp_weights_(work), u)

        rows, _, groups = self._candidates(work, md)
        u_trunc = u if rows is None else u.index_select(0, rows)
        trunc_ids = torch.empty(u_trunc.shape[0], dtype=torch.int64, device=dev)
        for group in groups:
            uu = u_trunc if group.rows is None else u_trunc.index_select(0, group.rows)
            tokens = group.sample(uu)
            if group.rows is None:
                trunc_ids = tokens
            else:
                trunc_ids.index_copy_(0, group.rows, tokens)
        if rows is None:
            return trunc_ids
        assert md.untrunc_rows is not None
        out = torch.empty(r, dtype=torch.int64, device=dev)
        out.index_copy_(0, rows, trunc_ids)
        if md.untrunc_rows.numel():
            plain = md.untrunc_rows.to(dev)
            out.index_copy_(
                0,
                plain,
                categorical_inverse_cdf(
                    exp_weights_(self.scratch.rows("plain", work, plain)), u.index_select(0, plain)
                ),
            )
        return out

    def _sample_exponential_race(self, work: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """vLLM's draw: argmax(probs / q), q ~ Exponential(1) per entry.

        Truncation masks by threshold (logit < cutoff), so tokens tied with
        the last kept candidate stay eligible."""
        r = work.shape[0]
        if md.top_k is not None:
            rows, sub, groups = self._candidates(work, md)
            cutoff = torch.empty(sub.shape[0], dtype=sub.dtype, device=sub.device)
            for group in groups:
                if group.rows is None:
                    cutoff = group.cutoff()
                else:
                    cutoff.index_copy_(0, group.rows, group.cutoff())
            sub.masked_fill_(sub < cutoff.unsqueeze(1), float("-inf"))
            if rows is not None:
                work.index_copy_(0, rows, sub)
        probs = torch.softmax(work, dim=-1)
        q = torch.empty_like(probs)
        if len(md.generators) != r:
            q.exponential_()
        for pos, gen in md.generators.items():
            q[pos].exponential_(generator=gen)
        # A zero draw would turn a masked (zero) probability into 0/0 = NaN,
        # which argmax would pick; the floor keeps it at 0.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return argmax_rows(probs.div_(q))

    # -- step 4: logprobs ---------------------------------------------------

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor,
        sampled: torch.Tensor,
        num_top: int,
        rows: torch.Tensor | None,
        scratch: Scratch,
    ) -> LogprobsTensors:
        """Batch-aligned logprobs from the raw logprobs of `rows` (None = all).

        Rows that did not ask get the sampled id in every column, NaN
        logprobs and rank 0 (impossible for a real rank), so nothing reads
        them by accident and none of the vocabulary-wide work is done."""
        asked = sampled if rows is None else sampled[rows.to(sampled.device)]
        token_ids = asked.unsqueeze(1)
        token_lp = logprobs.gather(1, token_ids)
        # Rank 1 = best; ties with the sampled token do not push it down.
        better = scratch.get("mask", logprobs.shape, torch.bool, logprobs.device)
        ranks = torch.gt(logprobs, token_lp, out=better).sum(-1).add_(1)
        if num_top > 0:
            top_lp, top_ids = topk_rows(logprobs, num_top)
            token_ids = torch.cat([token_ids, top_ids], 1)
            token_lp = torch.cat([token_lp, top_lp], 1)
        if rows is None:
            return LogprobsTensors(logprob_token_ids=token_ids, logprobs=token_lp, ranks=ranks)
        b = sampled.shape[0]
        dev = sampled.device
        idx = rows.to(dev)
        all_ids = sampled.unsqueeze(1).expand(b, num_top + 1).clone()
        all_ids.index_copy_(0, idx, token_ids)
        all_lp = torch.full((b, num_top + 1), float("nan"), device=dev)
        all_lp.index_copy_(0, idx, token_lp)
        all_ranks = torch.zeros(b, dtype=torch.int64, device=dev)
        all_ranks.index_copy_(0, idx, ranks)
        return LogprobsTensors(logprob_token_ids=all_ids, logprobs=all_lp, ranks=all_ranks)


@dataclass
class _Candidates:
    """The surviving tokens of some truncated rows, best first.

    Row i keeps `token_ids[i, :n_keep[i]]` (n_keep >= 1), whose logits are
    `values[i, :n_keep[i]]` in descending order; columns from n_keep on are
    dropped. `rows` gives these rows' positions among the truncated rows
    (None = all of them, in order).
    """

    rows: torch.Tensor | None
    values: torch.Tensor  # [n, W] float32, sorted descending
    token_ids: torch.Tensor  # [n, W] int64
    n_keep: torch.Tensor  # [n] int64

    def cutoff(self) -> torch.Tensor:
        """Per row, the smallest kept logit."""
        return self.values.gather(1, (self.n_keep - 1).unsqueeze(1)).squeeze(1)

    def sample(self, u: torch.Tensor) -> torch.Tensor:
        """One token per row, P(token) proportional to exp(logit), using u.

        Every step is row-local and independent of the width W (elementwise
        exp relative to the row's first value, a sequential cumsum whose
        trailing zeros change nothing), so a row's token does not depend on
        which other rows share the batch.
        """
        width = int(self.n_keep.max())
        vals = self.values[:, :width].double()
        dropped = torch.arange(width, device=vals.device).unsqueeze(0) >= self.n_keep.unsqueeze(1)
        dropped |= vals == float("-inf")  # kept by top-k/top-p but masked by min_p
        # The floor keeps float64 exp off its subnormal slow path; dropped
        # columns are zeroed after the exp instead of exp(-inf).
        weights = (vals - vals[:, :1]).clamp_(min=-700.0).exp_().masked_fill_(dropped, 0.0)
        cdf = weights.cumsum(-1)
        j = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        # Only u * total rounding up to total can overshoot; the answer is
        # then the last column with positive weight (weights are sorted, so
        # those form a prefix; min_p may have zeroed some kept columns). A
        # row without one (its top logit not finite, which a finite forward
        # and bounded processing never give) takes its top candidate rather
        # than index column -1 and end the engine for every request.
        n_positive = (weights > 0).sum(-1)
        # Said only on the CPU: on CUDA the check would add a device sync to
        # every sampled step, beside the one the step already has.
        if weights.device.type == "cpu" and bool((n_positive == 0).any()):
            logger.warning(
                "sampling rows without a finite top candidate (top logits %s); each takes its top candidate",
                vals[n_positive == 0, 0].tolist(),
            )
        j = torch.minimum(j, n_positive - 1).clamp_(min=0)
        return self.token_ids.gather(1, j.unsqueeze(1)).squeeze(1)


def top_k_top_p_candidates(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    max_top_k: int,
    top_p_without_top_k: bool,
    prefilter: int = _TOP_P_PREFILTER,
    full_total: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> list[_Candidates]:
    """Per row, the tokens that survive top-k then top-p (vLLM semantics:
    top-p applies to the top-k distribution renormalised).

    logits: [T, V]; top_k: [T] (0 = off, else < V); top_p: [T] or None
    (1.0 = off); every row truncates by at least one of them. Looks at the
    fewest top columns that can hold every row's answer: `max_top_k` when
    each top-p row also has a top-k, else `prefilter` columns; rows whose
    nucleus is wider retry with more (then a full sort) as further groups.
    `full_total` (internal) carries the rows' whole-vocabulary weight sums
    into those retries; `scratch` lends the buffer they are computed in.
    The top token is always kept.
    """
    t, v = logits.shape
    dev = logits.device
    if top_p is None:
        vals, ids = topk_rows(logits, max_top_k)
        return [_Candidates(None, vals, ids, top_k.clamp(max=max_top_k))]

    width = max(max_top_k, prefilter) if top_p_without_top_k else max_top_k
    if width * 4 > v:
        width = v
    if width >= v:
        vals, ids = logits.sort(dim=-1, descending=True)
    else:
        vals, ids = topk_rows(logits, width)
    k_eff = torch.where(top_k > 0, top_k, torch.full_like(top_k, v))
    pos = torch.arange(width, device=dev)
    in_k = pos.unsqueeze(0) < k_eff.unsqueeze(1)
    # Weights relative to the row max, which is column 0 of both the
    # candidates and the full row, so the sums below share one reference.
    weights = exp_weights_(vals.masked_fill(~in_k, float("-inf")))
    # Rows with top-k renormalise over it; rows without renormalise over the
    # whole vocabulary, which a prefilter does not hold.
    total = weights.sum(-1)
    if top_p_without_top_k:
        if full_total is None:
            if scratch is None:
                copy = logits.clone()
            else:
                copy = scratch.get("full", (t, v), logits.dtype, dev).copy_(logits)
            full_total = exp_weights_(copy).sum(-1)
        total = torch.where(top_k > 0, total, full_total)
    probs = weights.div_(total.unsqueeze(1))
    cdf = probs.cumsum(-1)
    # Mass strictly before each position: monotone, so "keep" is a prefix.
    before = torch.cat([torch.zeros(t, 1, device=dev, dtype=cdf.dtype), cdf[:, :-1]], 1)
    keep = (before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    keep &= in_k
    keep[:, 0] = True
    n_keep = keep.sum(-1)

    if width < v and top_p_without_top_k:
        # A nucleus provably fits only when the candidates' mass reached p.
        unresolved = (top_k == 0) & (top_p < 1.0) & (cdf[:, -1] < top_p)
        if bool(unresolved.any()):
            redo = unresolved.nonzero().squeeze(1)
            assert full_total is not None
            groups: list[_Candidates] = []
            for wider in top_k_top_p_candidates(
                logits.index_select(0, redo),
                top_k.index_select(0, redo),
                top_p.index_select(0, redo),
                0,
                True,
                prefilter=width * _TOP_P_GROWTH,
                full_total=full_total.index_select(0, redo),
            ):
                where = redo if wider.rows is None else redo.index_select(0, wider.rows)
                groups.append(_Candidates(where, wider.values, wider.token_ids, wider.n_keep))
            done = (~unresolved).nonzero().squeeze(1)
            if done.numel():
                groups.append(
                    _Candidates(
                        done,
                        vals.index_select(0, done),
                        ids.index_select(0, done),
                        n_keep.index_select(0, done),
                    )
                )
            return groups
    return [_Candidates(None, vals, ids, n_keep)]
