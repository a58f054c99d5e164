"""The float32 CPU GEMMs of one model step, every candidate of
kernels/gemm_select.py at the row counts a step has (decode: one row per
request), and the plan the engine would choose from these timings.

    python bench/gemm.py [--preset llama25m | --model DIR] [--rows 1,2,4,8,16,32,64,128,256,512]

Candidates: `linear` (torch's own `F.linear` on `[out, in]`), `mm_t` (MKL on
the transposed weight), `packed` (kernels/csrc_gemm.c, the variant this CPU
selects, or `RAYVLLM_CPU_ISA`), `mkldnn` (oneDNN's prepacked weight). Shapes
come from the model's config.json: per decoder layer the fused QKV, output,
fused gate/up and down projections, plus the LM head. Weights are cold as
in a real step: each shape is timed over several copies of its weight
(gemm_select.measure). Prints one row per (rows, shape) and per row count
the step total (per-layer shapes times the layer count plus the LM head)
for each candidate alone and for the plan. All candidates run the same
inputs in this one process, so ratios hold on a noisy machine. To measure
the AVX2 path on an AVX-512 machine: `RAYVLLM_CPU_ISA=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/gemm.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PRESETS, build_model, cpu_line, ensure_repo_on_path  # noqa: E402

ensure_repo_on_path()
from rayvllm.kernels import gemm_select  # noqa: E402

WEIGHT_COPIES = 8


def step_shapes(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, uses per step)."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    return [
        ("qkv", (heads + 2 * kv) * head_dim, hidden, layers),
        ("o", hidden, heads * head_dim, layers),
        ("gate_up", 2 * inter, hidden, layers),
        ("down", hidden, inter, layers),
        ("lm_head", cfg["vocab_size"], hidden, 1),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(map(str, gemm_select.ROW_BUCKETS)))
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    model_dir = Path(args.model) if args.model else build_model(None, args.preset)
    cfg = json.loads((model_dir / "config.json").read_text())
    candidates = gemm_select.available_candidates()
    gen = torch.Generator().manual_seed(0)
    tables: dict[str, dict[str, list[float]]] = {}
    for name, n, k, _ in step_shapes(cfg):
        copies = 1 if name == "lm_head" else WEIGHT_COPIES
        weights = [torch.randn(n, k, generator=gen) for _ in range(copies)]
        tables[name] = gemm_select.measure(weights, candidates, rows_list)
        del weights
    print(f"{model_dir.name}; {cpu_line()}; {torch.get_num_threads()} torch threads")
    print("us per call, weights cold; 'plan' = the candidate gemm_select.choose keeps at that row count")
    head = f"{'rows':>5} {'shape':>8} {'out x in':>12} " + " ".join(f"{c:>9}" for c in candidates)
    print(head + f" {'plan':>9} {'linear/plan':>11}")
    plans = {name: gemm_select.choose(table) for name, table in tables.items()}
    for i, rows in enumerate(rows_list):
        totals = dict.fromkeys([*candidates, "plan"], 0.0)
        for name, n, k, uses in step_shapes(cfg):
            table = tables[name]
            picked = plans[name].by_bucket[i] if len(rows_list) == len(gemm_select.ROW_BUCKETS) else min(
                table, key=lambda c: table[c][i])
            for c in candidates:
                totals[c] += table[c][i] * uses
            totals["plan"] += table[picked][i] * uses
            times = " ".join(f"{table[c][i] * 1e6:>9.1f}" for c in candidates)
            gain = table["linear"][i] / table[picked][i]
            print(f"{rows:>5} {name:>8} {f'{n} x {k}':>12} {times} {picked:>9} {gain:>10.2f}x")
        times = " ".join(f"{totals[c] * 1e6:>9.0f}" for c in candidates)
        gain = totals["linear"] / totals["plan"]
        print(f"{rows:>5} {'step':>8} {'':>12} {times} {totals['plan'] * 1e6:>9.0f} {gain:>10.2f}x")


if __name__ == "__main__":
    main()
