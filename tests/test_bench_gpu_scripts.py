"""Smoke tests for the benchmark scripts, run on the CPU at the tiny preset:
they start, produce a well-formed table and import no Ray. No timing is
asserted; the qwen3-0.6b preset is checked for shape and dtype without
building its 0.6B weights. decode_roofline.py and throughput.py run (and
their tables are checked) in tests/test_gpu_proof.py, inside the GPU proof's
smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bench_scripts import BENCH, load_bench_script


def _load_common() -> ModuleType:
    return load_bench_script("_common.py")


@pytest.fixture(scope="module")
def script_env(no_ray_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Presets built in a temporary cache; no Ray, in the scripts and their children."""
    return {**no_ray_env, "RAYVLLM_BENCH_CACHE": str(tmp_path_factory.mktemp("bench_scripts") / "cache")}


def _run(argv: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300, cwd=BENCH.parent
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


def test_qwen3_preset_shape_and_bf16_checkpoint(tmp_path: Path) -> None:
    """The preset's architecture has Qwen3-0.6B's parameter count; a
    one-layer, small-vocabulary build of it saves bfloat16 weights."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rayvllm.utils.random_model import RandomModelSpec, _hf_config, build_random_model

    preset = _load_common().PRESETS["qwen3-0.6b"]
    config = _hf_config(RandomModelSpec(**preset))
    assert (config.num_hidden_layers, config.head_dim, config.tie_word_embeddings) == (28, 128, True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920

    path = build_random_model(tmp_path, RandomModelSpec(**{**preset, "num_hidden_layers": 1, "vocab_size": 4096}))
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_gemm_bench_names_its_cpu_and_plan(script_env: dict[str, str]) -> None:
    """bench/gemm.py (issue 14): the CPU line heads the table, every shape
    and the step total get a row per row count, and the plan column names a
    candidate that was timed."""
    from rayvllm.kernels import gemm_select
    from rayvllm.kernels.cpu_isa import cpu_info

    out = _run([str(BENCH / "gemm.py"), "--preset", "tiny", "--rows", "1,4"], script_env)
    lines = out.splitlines()
    assert cpu_info().model in lines[0] and "rayvllm kernels" in lines[0]
    rows = [line.split() for line in lines if line.split()[:1] in (["1"], ["4"])]
    assert [r[1] for r in rows] == ["qkv", "o", "gate_up", "down", "lm_head", "step"] * 2
    candidates = gemm_select.available_candidates()
    assert all(r[-2] in candidates for r in rows if r[1] != "step")


def test_window_decode_bench_table(script_env: dict[str, str], tmp_path: Path) -> None:
    """bench/window_decode.py (issue 59): both models at both contexts, the
    target line, and the JSON's ratio from the windowed model's medians."""
    out_json = tmp_path / "window.json"
    out = _run([str(BENCH / "window_decode.py"), "--window", "32", "--batch", "2", "--steps", "2",
                "--warmup-steps", "1", "--repeats", "1", "--json-out", str(out_json)], script_env)
    rows = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["windowed"], ["full"])]
    assert rows == [["windowed", "32"], ["windowed", "128"], ["full", "32"], ["full", "128"]]
    assert "target: windowed decode at context 128 no slower than at 32:" in out
    summary = json.loads(out_json.read_text())
    windowed = summary["step_ms"]["windowed"]
    assert summary["ratio"] == pytest.approx(windowed["128"][0] / windowed["32"][0])
