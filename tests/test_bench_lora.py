"""bench/lora.py's ratio table: each setting against the same engine's
base/lora-off, and rayvllm against vLLM per setting (no engine runs here)."""

from __future__ import annotations

from bench_scripts import load_bench_script


def test_each_setting_against_its_engines_base_and_the_peer() -> None:
    bench = load_bench_script("lora.py")
    results = [
        {"engine": "vllm", "setting": "base/lora-off", "tok_s": 1600.0, "error": None},
        {"engine": "vllm", "setting": "base/lora-on", "tok_s": 400.0, "error": None},
        {"engine": "vllm", "setting": "mixed", "error": "killed"},
        {"engine": "rayvllm", "setting": "base/lora-off", "tok_s": 2400.0, "error": None},
        {"engine": "rayvllm", "setting": "base/lora-on", "tok_s": 2280.0, "error": None},
        {"engine": "rayvllm", "setting": "mixed", "tok_s": 1800.0, "error": None},
    ]
    assert bench.ratio_rows(results, ["vllm", "rayvllm"]) == [
        ["base/lora-off", "1.00x", "1.00x", "1.50x"],
        ["base/lora-on", "0.25x", "0.95x", "5.70x"],
        ["mixed", "-", "0.75x", "-"],
    ]
    assert bench.ratio_rows(results[3:], ["rayvllm"]) == [
        ["base/lora-off", "1.00x"], ["base/lora-on", "0.95x"], ["mixed", "0.75x"],
    ]
