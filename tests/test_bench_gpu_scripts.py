"""Smoke tests for issue 5's GPU benchmark scripts, run on the CPU at the
tiny preset: the scripts start, produce a well-formed table and import no
Ray (the GPU machine has none). No timing is asserted; the qwen3-0.6b
preset is checked for shape and dtype without building its 0.6B weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load_common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Presets built in a temporary cache; a `ray` package that cannot be
    imported shadows the real one, in the scripts and their children."""
    root = tmp_path_factory.mktemp("bench_scripts")
    fake = root / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("ray is blocked in this test")\n')
    env = dict(os.environ)
    env["RAYVLLM_BENCH_CACHE"] = str(root / "cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(fake.parent), env.get("PYTHONPATH", "")) if p)
    return env


def _run(argv: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300, cwd=BENCH.parent
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result.stdout


def test_decode_roofline_cpu_table(script_env: dict[str, str], tmp_path: Path) -> None:
    json_out = tmp_path / "roofline.json"
    out = _run(
        [str(BENCH / "decode_roofline.py"), "--preset", "tiny", "--device", "cpu", "--batch-sizes", "2,3",
         "--context-len", "12", "--steps", "2", "--warmup-steps", "1", "--copy-mib", "8",
         "--json-out", str(json_out)],
        script_env,
    )
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("B "))
    assert lines[header].split()[:4] == ["B", "context/seq", "step", "ms"]
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [r[0] for r in rows] == ["2", "3"]
    for row in rows:
        # context, step ms, floor ms, bound, weights MB, KV MB, step/floor, % of roofline
        assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0 and row[4] in ("memory", "compute")
        assert float(row[5]) > 0 and float(row[6]) > 0 and float(row[7].rstrip("x")) > 0
        assert float(row[8].rstrip("%")) > 0
    assert sum(line.startswith("target B=") for line in lines) == 2
    assert "informational" in out
    summary = json.loads(json_out.read_text())
    assert summary["cuda_graphs"] is False and summary["copy_bandwidth_bytes_per_s"] > 0
    # On a CPU the floor is the larger of the memory and the compute floor.
    assert summary["gemm_peak_flops"] > 0
    for r in summary["results"]:
        # Decoding 12-token prompts: every timed step attends over more than the prompt.
        assert r["mean_context"] > 12 and r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])


def test_throughput_rayvllm_and_transformers(script_env: dict[str, str]) -> None:
    out = _run(
        [str(BENCH / "throughput.py"), "--preset", "tiny", "--engines", "rayvllm,transformers",
         "--num-seqs", "4", "--min-len", "8", "--max-len", "16"],
        script_env,
    )
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("rayvllm ", "transformers "))}
    assert set(rows) == {"rayvllm", "transformers"}
    # Both engines produced every requested token (the child checks the count) at a positive rate.
    assert rows["rayvllm"][1] == rows["transformers"][1]
    assert float(rows["rayvllm"][3]) > 0 and float(rows["transformers"][3]) > 0


def test_qwen3_preset_shape_and_bf16_checkpoint(tmp_path: Path) -> None:
    """The preset's architecture has Qwen3-0.6B's parameter count; a
    one-layer, small-vocabulary build of it saves bfloat16 weights."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rayvllm.models.random_model import RandomModelSpec, _hf_config, build_random_model

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
