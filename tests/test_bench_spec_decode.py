"""bench/spec_decode.py's second table: each engine's speculation against
its own run without it, and rayvllm's TPOT against vLLM's, from the
children's results (no engine runs here)."""

from __future__ import annotations

from bench_scripts import load_bench_script


def _run(tpot_ms: float, tok_s: float) -> dict[str, float]:
    return {"tpot_s": tpot_ms / 1000, "tok_s": tok_s}


def test_speedups_are_against_each_engines_own_baseline() -> None:
    bench = load_bench_script("spec_decode.py")
    results = {
        "rayvllm/none": {"workloads": {"echo": _run(4.0, 1000.0), "random": _run(4.0, 1500.0)}},
        "rayvllm/ngram": {"workloads": {"echo": _run(3.0, 1100.0), "random": _run(4.0, 1200.0)}},
        "vllm/none": {"workloads": {"echo": _run(8.0, 600.0), "random": _run(8.0, 900.0)}},
        "vllm/ngram": {"workloads": {"echo": _run(6.0, 450.0), "random": _run(10.0, 600.0)}},
        "vllm/draft_model": {"error": "not supported"},
    }
    rows = bench.speedup_rows(results, ["rayvllm", "vllm"], ["none", "ngram", "draft_model"])  # type: ignore[attr-defined]
    assert rows == [
        ["ngram", "echo", "0.75x", "0.75x", "1.10x", "0.75x", "0.50x"],
        ["ngram", "random", "1.00x", "1.25x", "0.80x", "0.67x", "0.40x"],
        # rayvllm's draft_model run is missing and vLLM's failed: every figure is "-".
        ["draft_model", "echo", "-", "-", "-", "-", "-"],
        ["draft_model", "random", "-", "-", "-", "-", "-"],
    ]
    # One engine: no cross-engine column.
    assert bench.speedup_rows(results, ["rayvllm"], ["none", "ngram"]) == [  # type: ignore[attr-defined]
        ["ngram", "echo", "0.75x", "1.10x"], ["ngram", "random", "1.00x", "0.80x"],
    ]
    # Without a run that has no speculation there is nothing to compare with.
    assert bench.speedup_rows(results, ["rayvllm"], ["ngram"]) == []  # type: ignore[attr-defined]
