"""CPU kernel choice: the ISA variants a CPU can run, the build cache keyed by
CPU, and the per-shape GEMM plan (chosen from timing tables given here, not
from wall-clock measurements)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from rayvllm.kernels import cbuild, cpu_isa, gemm_select
from rayvllm.kernels.cpu_isa import CpuInfo, parse_cpuinfo, selected_isa
from rayvllm.kernels.gemm_select import ROW_BUCKETS, GemmPlan, PlannedGemm, bucket_index, choose

EPYC_ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c bmi1 avx2 bmi2 sha_ni
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2 fma movbe avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512bw avx512vl amx_tile avx512_bf16
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp
"""


def test_isa_variants_from_cpuinfo() -> None:
    epyc = parse_cpuinfo(EPYC_ZEN3, "x86_64")
    assert epyc.model == "AMD EPYC 7B13"
    assert epyc.supported_isas == ("avx2", "portable")
    assert epyc.isa_summary == "AVX2+FMA (no AVX-512)"
    spr = parse_cpuinfo(SAPPHIRE_RAPIDS, "x86_64")
    assert spr.supported_isas == ("avx512", "avx2", "portable")
    assert spr.isa_summary == "AVX-512, +AMX, +BF16"
    arm = parse_cpuinfo(GRAVITON, "aarch64")
    assert arm.supported_isas == ("portable",)


def test_forced_isa_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    epyc = parse_cpuinfo(EPYC_ZEN3, "x86_64")
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    assert selected_isa(epyc) == "avx2"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "portable")
    assert selected_isa(epyc) == "portable"
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="cannot run it; it runs avx2, portable"):
        selected_isa(epyc)
    monkeypatch.setenv(cpu_isa.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="choose one of avx512, avx2, portable"):
        selected_isa(epyc)


@pytest.mark.skipif(cpu_isa.cpu_info().arch != "x86_64", reason="x86 variants build on x86 only")
def test_every_x86_variant_builds_and_the_cache_is_keyed_by_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Each variant compiles whatever this CPU runs (AVX-512 included on an
    AVX2 machine); another CPU model gets another library file."""
    if cbuild.build_library("csrc_gemm.c", [], "portable") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("RAYVLLM_CACHE_DIR", str(tmp_path))
    here = {isa: cbuild.build_library("csrc_gemm.c", [], isa) for isa in cpu_isa.ISAS}
    assert all(path is not None and path.exists() for path in here.values())
    assert len(set(here.values())) == 3
    other = CpuInfo(model="AMD EPYC 7B13", arch="x86_64", flags=parse_cpuinfo(EPYC_ZEN3, "x86_64").flags)
    monkeypatch.setattr(cbuild, "cpu_info", lambda: other)
    elsewhere = cbuild.build_library("csrc_gemm.c", [], "avx2")
    assert elsewhere is not None and elsewhere != here["avx2"]
    # An AVX2 CPU is never handed the AVX-512 build.
    assert cbuild.load_library("csrc_gemm.c", [], "avx512") is None


def test_bucket_index() -> None:
    expected = {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 16: 4, 17: 5, 512: 9, 513: 9, 8192: 9}
    assert {rows: bucket_index(rows) for rows in expected} == expected
    assert all(bucket_index(rows) == i for i, rows in enumerate(ROW_BUCKETS))


def _table(**rows: list[float]) -> dict[str, list[float]]:
    assert all(len(v) == len(ROW_BUCKETS) for v in rows.values())
    return rows


def test_one_layout_when_it_is_within_noise_everywhere() -> None:
    table = _table(
        linear=[10, 20, 30, 40, 50, 60, 70, 80, 90, 100],
        mm_t=[9, 19, 29, 39, 49, 59, 69, 79, 89, 99],
        packed=[9.1, 19.1, 29.1, 39.1, 49.1, 59.1, 69.1, 79.1, 89.1, 99.1],
    )
    plan = choose(table)
    assert plan.layouts == ("mm_t",)
    assert plan.describe() == "rows 1-max mm_t"


def test_split_plan_takes_each_bucket_fastest() -> None:
    table = _table(
        linear=[10, 20, 30, 40, 50, 60, 70, 80, 90, 100],
        mm_t=[12, 22, 32, 42, 52, 62, 72, 70, 80, 90],
        packed=[5, 10, 15, 20, 25, 30, 35, 90, 95, 120],
    )
    plan = choose(table)
    assert plan.by_bucket == ("packed",) * 7 + ("mm_t",) * 3
    assert plan.layouts == ("mm_t", "packed")
    assert plan.describe() == "rows 1-64 packed, rows 65-max mm_t"
    assert plan.pick(48) == "packed" and plan.pick(65) == "mm_t" and plan.pick(4096) == "mm_t"


def test_plan_never_slower_than_torch_linear_beyond_tolerance() -> None:
    """Random tables: at every bucket the plan's candidate is within the
    tolerance of the fastest, hence of torch's own `linear`."""
    rng = random.Random(7)
    for _ in range(300):
        names = ["linear"] + rng.sample(["mm_t", "packed", "mkldnn"], rng.randint(0, 3))
        table = {n: [rng.uniform(1, 10) for _ in ROW_BUCKETS] for n in names}
        plan = choose(table)
        for b, name in enumerate(plan.by_bucket):
            fastest = min(t[b] for t in table.values())
            assert table[name][b] <= fastest * (1 + gemm_select.TOLERANCE)
            assert table[name][b] <= table["linear"][b] * (1 + gemm_select.TOLERANCE)


@pytest.mark.parametrize("candidate", ["linear", "mm_t", "packed", "mkldnn"])
def test_planned_gemm_matches_f_linear(candidate: str) -> None:
    if candidate not in gemm_select.available_candidates():
        pytest.skip(f"{candidate} is not available here")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(70, 40, generator=gen)
    gemm = PlannedGemm(weight, GemmPlan((candidate,) * len(ROW_BUCKETS)))
    for rows in (1, 3, 13, 600):
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(gemm(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keeps_linear", [True, False])
def test_a_loaded_weight_is_multiplied_as_a_new_plan_would_in_the_same_storage(keeps_linear: bool) -> None:
    """`load` refills every layout a split plan keeps: products equal those of a
    plan built on the new weight, bit for bit, and the layouts that can stay put
    do. The staging tensor is the `linear` layout where the plan keeps one, else
    a view of the scratch arena, which no layout reads after `load` (the next
    module's weight overwrites it)."""
    candidates = [c for c in ("linear", "mm_t", "packed", "mkldnn") if c in gemm_select.available_candidates()]
    if not keeps_linear:
        candidates.remove("linear")
    plan = GemmPlan(tuple(candidates[i % len(candidates)] for i in range(len(ROW_BUCKETS))))
    gen = torch.Generator().manual_seed(4)
    old, new = torch.randn(70, 40, generator=gen), torch.randn(70, 40, generator=gen)
    gemm = PlannedGemm(old.clone(), plan)
    kept = {c: t.data_ptr() for c, t in gemm.layouts.items() if c != "mkldnn"}
    arena = torch.full((70 * 40 + 3,), float("nan"))
    staging = gemm.staging(arena)
    assert (staging.data_ptr() == arena.data_ptr()) != keeps_linear
    staging.copy_(new)
    gemm.load(staging)
    arena.fill_(float("nan"))
    fresh = PlannedGemm(new.clone(), plan)
    assert {c: t.data_ptr() for c, t in gemm.layouts.items() if c != "mkldnn"} == kept
    for rows in (1, 3, 13, 40, 600):
        x = torch.randn(rows, 40, generator=gen)
        assert torch.equal(gemm(x), fresh(x)), (rows, plan.pick(rows))
    with pytest.raises(ValueError, match="weight"):
        gemm.load(torch.zeros(40, 70))


def test_layers_keep_only_the_plans_layouts() -> None:
    """A Linear drops its `[out, in]` parameter for the plan's layouts (bias
    still added); the LM head keeps `weight`, which the embedding may share;
    a split plan runs each bucket's candidate."""
    from rayvllm.distributed.parallel_state import ParallelContext
    from rayvllm.layers.linear import Linear
    from rayvllm.layers.vocab_parallel import ParallelLMHead

    gen = torch.Generator().manual_seed(5)
    plan = GemmPlan(("mm_t",) * 5 + ("linear",) * 5)
    layer = Linear(40, 70, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(70, 40, generator=gen))
        layer.bias.copy_(torch.randn(70, generator=gen))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.use_gemm_plan(plan)
    assert layer.weight is None and layer.gemm is not None
    for rows in (1, 16, 17, 300):
        x = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)

    head = ParallelLMHead(70, 40, ParallelContext())
    with torch.no_grad():
        head.weight.copy_(torch.randn(70, 40, generator=gen))
    head.use_gemm_plan(plan)
    assert head.weight is not None
    for rows in (1, 9, 300):
        h = torch.randn(rows, 40, generator=gen)
        torch.testing.assert_close(head(h), F.linear(h, head.weight), atol=1e-5, rtol=1e-5)


def test_plans_are_cached_per_shape(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The first load of a shape times it; a restart reads the plan back; a
    new shape is timed again."""
    monkeypatch.setenv("RAYVLLM_CACHE_DIR", str(tmp_path))
    timed: list[tuple[int, int]] = []

    def fake_measure(weights, candidates, buckets=ROW_BUCKETS):
        timed.append(tuple(weights[0].shape))
        return {c: [1.0 if c == "mm_t" else 2.0] * len(buckets) for c in candidates}

    monkeypatch.setattr(gemm_select, "measure", fake_measure)
    weights = [torch.zeros(24, 8) for _ in range(3)]
    assert gemm_select.plan_for(weights, ["linear", "mm_t"]).layouts == ("mm_t",)
    assert gemm_select.plan_for(weights, ["linear", "mm_t"]).layouts == ("mm_t",)
    assert timed == [(24, 8)]
    gemm_select.plan_for([torch.zeros(8, 24)], ["linear", "mm_t"])
    assert timed == [(24, 8), (8, 24)]
    assert len(list((tmp_path / "gemm_plans").glob("*.json"))) == 2


def test_a_failing_candidate_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library path that raises on this build is left out of the table;
    torch's own `linear` always stays."""
    real = gemm_select.make_layout

    def broken_mkldnn(candidate: str, weight: torch.Tensor) -> torch.Tensor:
        if candidate == "mkldnn":
            raise RuntimeError("no oneDNN reorder on this build")
        return real(candidate, weight)

    monkeypatch.setattr(gemm_select, "make_layout", broken_mkldnn)
    table = gemm_select.measure([torch.randn(16, 8)], ["linear", "mm_t", "mkldnn"], buckets=(1, 2))
    assert sorted(table) == ["linear", "mm_t"] and all(len(v) == 2 for v in table.values())


def test_an_unwritable_plan_cache_is_not_fatal(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A read-only cache directory only means timing again at the next start."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("RAYVLLM_CACHE_DIR", str(blocker))
    monkeypatch.setattr(gemm_select, "measure", lambda weights, candidates, buckets=ROW_BUCKETS: {
        c: [1.0] * len(buckets) for c in candidates})
    assert gemm_select.plan_for([torch.zeros(4, 4)], ["linear"]).layouts == ("linear",)
