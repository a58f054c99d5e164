"""Which float32 CPU GEMM serves a weight shape at which row count, chosen
at load by timing the candidates on the CPU the model runs on.

No kernel wins everywhere (docs/BENCHMARKS.md, issue 14): the packed C
kernel leads at decode row counts where MKL re-reads the weight, MKL leads
at large prefill products, and which of MKL's layouts is faster depends on
the shape and the CPU. So each group of same-shape weights (a layer's q/k/v
product in every layer, say) is timed once per candidate at the row counts
steps use, on a few of its real weights (cold in cache, as in a step), and
the fastest candidate per row bucket is kept.

Candidates (each with its own weight layout):
  linear   `F.linear` on the checkpoint's `[out, in]` weight: torch's own path
  mm_t     `torch.mm` on a contiguous `[in, out]` copy (MKL, no transpose)
  packed   kernels/cpu_gemm.py on column tiles packed for this CPU's variant
  mkldnn   oneDNN's prepacked weight (`torch.ops.mkldnn._linear_pointwise`),
           which dispatches by ISA itself (AVX2, AVX-512, AMX)

Invariant: at every bucket the plan's candidate measured within `TOLERANCE`
(the timing noise) of the fastest candidate, `linear` included, so no row
count runs slower than torch's own path. A plan keeps as few layouts as
that allows (one copy of the weight when one candidate is good enough
everywhere). Plans are cached on disk per CPU model, kernel variant, torch
version, thread count and shape, so a restart does not time again.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F

from rayvllm.kernels import cpu_gemm
from rayvllm.kernels.cpu_isa import cpu_info
from rayvllm.kernels.host_memory import empty_huge
from rayvllm.utils.paths import cache_dir

logger = logging.getLogger(__name__)

CANDIDATES = ("linear", "mm_t", "packed", "mkldnn")
# Row counts timed; a step's rows use the smallest bucket >= them, and rows
# past the last bucket use the last one's choice.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Two candidates within this fraction of each other are a tie (run-to-run
# noise of the timing on a quiet machine).
TOLERANCE = 0.03
# Weights of a group used for timing: enough bytes that they do not all sit
# in cache, few enough that every candidate's layout fits in memory at once.
_TIMING_BYTES = 64 << 20
_TIMING_MAX_WEIGHTS = 8
# Timing per (candidate, bucket): at least this many passes over the weights
# and this long, best pass kept.
_MIN_PASSES = 3
_MIN_SECONDS = 0.01

Layout = torch.Tensor
GemmFn = Callable[[torch.Tensor, Layout], torch.Tensor]


def bucket_index(rows: int) -> int:
    """Index into ROW_BUCKETS of the bucket serving `rows` (>= 1)."""
    return min((rows - 1).bit_length(), len(ROW_BUCKETS) - 1)


def available_candidates() -> tuple[str, ...]:
    """The candidates this process can run (packed needs the C kernel, mkldnn oneDNN)."""
    names = ["linear", "mm_t"]
    if cpu_gemm.available():
        names.append("packed")
    if torch.backends.mkldnn.is_available():
        names.append("mkldnn")
    return tuple(names)


def make_layout(candidate: str, weight: torch.Tensor, out: Layout | None = None) -> Layout:
    """`weight` `[out, in]` in the layout `candidate` multiplies; with `out`
    (that layout of an earlier weight of the same shape), written into its
    storage where the layout allows (all but oneDNN's opaque one, made anew)."""
    weight = weight.detach()
    if candidate == "linear":
        if out is None:
            return weight.contiguous()
        return out if out.data_ptr() == weight.data_ptr() else out.copy_(weight)
    if candidate == "mm_t":
        target = empty_huge((weight.shape[1], weight.shape[0])) if out is None else out
        return cpu_gemm.transpose(weight, target) if cpu_gemm.available() else target.copy_(weight.t())
    if candidate == "packed":
        return cpu_gemm.pack_weight(weight, out=out)
    if candidate == "mkldnn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    raise ValueError(f"unknown GEMM candidate {candidate!r}")


def gemm_fn(candidate: str, out_features: int) -> GemmFn:
    """`fn(x, layout) = x @ W^T` for `candidate`'s layout of `W`."""
    if candidate == "linear":
        return lambda x, w: F.linear(x, w)
    if candidate == "mm_t":
        return lambda x, w: torch.mm(x, w)
    if candidate == "packed":
        return lambda x, w: cpu_gemm.gemm(x, w, out_features)
    if candidate == "mkldnn":
        return lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    raise ValueError(f"unknown GEMM candidate {candidate!r}")


@dataclass(frozen=True)
class GemmPlan:
    """`by_bucket[i]`: the candidate for rows in ROW_BUCKETS[i]'s bucket."""

    by_bucket: tuple[str, ...]

    @property
    def layouts(self) -> tuple[str, ...]:
        """Candidates whose weight layout must be kept, in CANDIDATES order."""
        return tuple(c for c in CANDIDATES if c in self.by_bucket)

    def pick(self, rows: int) -> str:
        return self.by_bucket[bucket_index(rows)]

    def describe(self) -> str:
        """e.g. `rows 1-16 packed, rows 17-max mm_t`."""
        parts, i = [], 0
        for name, group in itertools.groupby(self.by_bucket):
            last = i + len(list(group)) - 1
            low = 1 if i == 0 else ROW_BUCKETS[i - 1] + 1
            high = str(ROW_BUCKETS[last]) if last < len(ROW_BUCKETS) - 1 else "max"
            parts.append(f"rows {low}-{high} {name}")
            i = last + 1
        return ", ".join(parts)


def choose(table: dict[str, Sequence[float]], tolerance: float = TOLERANCE) -> GemmPlan:
    """The plan for a timing table `{candidate: seconds per bucket}`.

    The smallest set of layouts whose best member is within `tolerance` of
    the fastest candidate at every bucket; among sets of that size, the one
    with the least total time; each bucket then runs the set's fastest."""
    if not table:
        raise ValueError("no GEMM candidate was timed")
    buckets = len(next(iter(table.values())))
    best = [min(times[b] for times in table.values()) for b in range(buckets)]
    names = [c for c in CANDIDATES if c in table]
    for size in range(1, len(names) + 1):
        fits = []
        for subset in itertools.combinations(names, size):
            per_bucket = [min(subset, key=lambda c: table[c][b]) for b in range(buckets)]
            if all(table[c][b] <= best[b] * (1 + tolerance) for b, c in enumerate(per_bucket)):
                fits.append((sum(table[c][b] for b, c in enumerate(per_bucket)), per_bucket))
        if fits:
            return GemmPlan(tuple(min(fits)[1]))
    raise AssertionError("the full candidate set always fits")


def measure(
    weights: Sequence[torch.Tensor], candidates: Sequence[str], buckets: Sequence[int] = ROW_BUCKETS
) -> dict[str, list[float]]:
    """Seconds per product at each bucket's row count, for each candidate, on
    a few of `weights` (same shape) in turn, so each call meets a weight
    that the previous call did not leave in cache."""
    out_features, in_features = weights[0].shape
    per_weight = weights[0].numel() * weights[0].element_size()
    count = max(1, min(len(weights), _TIMING_MAX_WEIGHTS, -(-_TIMING_BYTES // per_weight)))
    sample = list(weights[:count])
    generator = torch.Generator().manual_seed(0)
    table: dict[str, list[float]] = {}
    for candidate in candidates:
        try:
            layouts = [make_layout(candidate, w) for w in sample]
            fn = gemm_fn(candidate, out_features)
            times = []
            for rows in buckets:
                x = torch.randn(rows, in_features, generator=generator)
                times.append(_time_passes(fn, x, layouts))
        except (RuntimeError, NotImplementedError) as e:
            # A library path this torch build or CPU lacks (oneDNN's reorder
            # on some Arm builds, say) is no candidate; torch's own always is.
            if candidate == "linear":
                raise
            logger.warning("GEMM candidate %s failed on %dx%d, not used: %s", candidate, out_features, in_features, e)
            continue
        table[candidate] = times
        del layouts
    return table


def _time_passes(fn: GemmFn, x: torch.Tensor, layouts: list[Layout]) -> float:
    for layout in layouts:
        fn(x, layout)
    best, passes, start = float("inf"), 0, time.perf_counter()
    while passes < _MIN_PASSES or time.perf_counter() - start < _MIN_SECONDS:
        t0 = time.perf_counter()
        for layout in layouts:
            fn(x, layout)
        best = min(best, (time.perf_counter() - t0) / len(layouts))
        passes += 1
    return best


def plan_for(weights: Sequence[torch.Tensor], candidates: Sequence[str] | None = None) -> GemmPlan:
    """The cached plan for this shape on this CPU, or a measured one (then cached)."""
    candidates = tuple(candidates or available_candidates())
    out_features, in_features = weights[0].shape
    key = _cache_key(out_features, in_features, candidates)
    path = cache_dir() / "gemm_plans" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if path.exists():
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return GemmPlan(tuple(cached["plan"]["by_bucket"]))
        except (OSError, ValueError, KeyError):
            logger.warning("ignoring unreadable GEMM plan cache %s", path)
    t0 = time.perf_counter()
    table = measure(weights, candidates)
    plan = choose(table)
    logger.info(
        "GEMM %dx%d (%d weights): %s (timed %s in %.1f s)",
        out_features, in_features, len(weights), plan.describe(), ", ".join(candidates), time.perf_counter() - t0,
    )
    try:
        _write_atomic(path, json.dumps({"key": key, "plan": asdict(plan), "table": table}))
    except OSError as e:  # a read-only cache costs a re-timing next start, nothing else
        logger.warning("could not cache the GEMM plan in %s: %s", path, e)
    return plan


class PlannedGemm:
    """One weight in the layouts its plan uses; each call runs the plan's
    candidate for its row count. A `linear` layout of a contiguous weight is
    the weight itself, not a copy."""

    def __init__(self, weight: torch.Tensor, plan: GemmPlan) -> None:
        self.plan = plan
        self.out_features, self.in_features = weight.shape
        self._bind({c: make_layout(c, weight) for c in plan.layouts})

    def _bind(self, layouts: dict[str, Layout]) -> None:
        self.layouts = layouts
        by_bucket = [functools.partial(gemm_fn(c, self.out_features), w=layouts[c]) for c in self.plan.by_bucket]
        # Indexed by row count (the last entry serves every larger count): the
        # hot path is one list lookup, no bucket arithmetic.
        self._for_rows = [by_bucket[bucket_index(max(rows, 1))] for rows in range(ROW_BUCKETS[-1] + 1)]

    def staging(self, arena: torch.Tensor) -> torch.Tensor:
        """An `[out, in]` tensor to load a new weight into before `load`: the
        `linear` layout itself where the plan keeps one (loading it is then
        the update), else a view of `arena` (scratch of at least out x in
        elements that `load` leaves no layout pointing into)."""
        if "linear" in self.layouts:
            return self.layouts["linear"]
        return arena[: self.out_features * self.in_features].view(self.out_features, self.in_features)

    def load(self, weight: torch.Tensor) -> None:
        """Every layout refreshed from `weight` `[out, in]` in the storage it
        had where the layout allows (`make_layout`): a weight update costs a
        copy per layout, not a rebuilt model."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight {tuple(weight.shape)} != ({self.out_features}, {self.in_features})")
        self._bind({c: make_layout(c, weight, out=layout) for c, layout in self.layouts.items()})

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return self._for_rows[rows if rows < len(self._for_rows) else -1](x)


class GemmModule(Protocol):
    """A layer multiplied by a `[out, in]` weight that can take a plan."""

    weight: torch.Tensor

    def use_gemm_plan(self, plan: GemmPlan) -> None: ...


# Every row count on the C kernel: it sums each output over K in one fixed
# order whatever the rows beside it, where oneDNN and MKL choose their
# kernels (and so their summation order) by row count.
BATCH_INVARIANT_PLAN = GemmPlan(("packed",) * len(ROW_BUCKETS))


def plan_modules(modules: Sequence[GemmModule], use_c_kernels: bool, batch_invariant: bool = False) -> None:
    """Give every module the plan of its weight shape: one plan per shape
    (cached, or timed on that shape's weights); the C kernel is a candidate
    only with `use_c_kernels`. With `batch_invariant`, `BATCH_INVARIANT_PLAN`
    for all (the caller checked that the C kernel is available)."""
    if batch_invariant:
        for module in modules:
            module.use_gemm_plan(BATCH_INVARIANT_PLAN)
        return
    candidates = [c for c in available_candidates() if use_c_kernels or c != "packed"]
    groups: dict[tuple[int, ...], list[GemmModule]] = {}
    for module in modules:
        groups.setdefault(tuple(module.weight.shape), []).append(module)
    for group in groups.values():
        plan = plan_for([m.weight for m in group], candidates)
        for module in group:
            module.use_gemm_plan(plan)


def _cache_key(out_features: int, in_features: int, candidates: Sequence[str]) -> str:
    info = cpu_info()
    isa = cpu_gemm.library_id() if "packed" in candidates else "-"
    fields = [info.model, isa, " ".join(sorted(info.flags)), torch.__version__, f"threads={torch.get_num_threads()}",
              f"{out_features}x{in_features}", ",".join(candidates), ",".join(map(str, ROW_BUCKETS)),
              os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""), os.environ.get("ONEDNN_MAX_CPU_ISA", "")]
    return "|".join(fields)


def _write_atomic(path: os.PathLike[str] | str, text: str) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
