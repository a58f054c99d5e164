"""The float32 CPU GEMMs of one model step: MKL (`torch.mm` on the transposed
weight, the layout used before kernels/csrc_gemm.c) against the packed-weight
C kernel, at the row counts a step has (decode: one row per request).

    python bench/gemm.py [--rows 1,2,4,8,16,48,128,256,1024] [--preset llama25m | --model DIR]
        [--iters 30]

Shapes come from the model's config.json: per decoder layer the fused QKV,
the output, the fused gate/up and the down projections, plus the LM head.
Weights are cold as in a real step (every layer's weights pass through the
caches between two uses of one): each shape cycles through enough copies of
its weight to fill 64 MB. Prints one row per (rows, shape) and, per row
count, the step total: per-layer shapes times the layer count plus the LM
head. Both engines run the same inputs in this one process, so the ratio
holds on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PRESETS, build_model, ensure_repo_on_path  # noqa: E402

ensure_repo_on_path()
from rayvllm.kernels import cpu_gemm  # noqa: E402

COLD_BYTES = 64 << 20


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


def time_us(calls: list[Callable[[], object]], iters: int) -> float:
    for call in calls[:3]:
        call()
    start = time.perf_counter()
    for i in range(iters):
        calls[i % len(calls)]()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,48,128,256,1024")
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    if not cpu_gemm.available():
        raise SystemExit("the C kernel did not build (no C compiler, or RAYVLLM_CPU_KERNELS=torch)")
    model_dir = Path(args.model) if args.model else build_model(None, args.preset)
    cfg = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    print(f"{model_dir.name}, {torch.get_num_threads()} torch threads; times in us per call, weights cold")
    print(f"{'rows':>5} {'shape':>8} {'out x in':>12} {'mkl':>10} {'packed':>10} {'mkl/packed':>10}")
    for rows in (int(r) for r in args.rows.split(",")):
        total_mkl = total_packed = 0.0
        for name, n, k, uses in step_shapes(cfg):
            copies = max(2, COLD_BYTES // (n * k * 4))
            weights = [torch.randn(n, k, generator=gen) for _ in range(copies)]
            x = torch.randn(rows, k, generator=gen)
            transposed = [w.t().contiguous() for w in weights]
            packed = [cpu_gemm.pack_weight(w) for w in weights]
            torch.testing.assert_close(cpu_gemm.gemm(x, packed[0], n), x @ transposed[0], atol=1e-3, rtol=1e-4)
            mkl = time_us([lambda w=w: torch.mm(x, w) for w in transposed], args.iters)
            ours = time_us([lambda w=w: cpu_gemm.gemm(x, w, n) for w in packed], args.iters)
            total_mkl += mkl * uses
            total_packed += ours * uses
            print(f"{rows:>5} {name:>8} {f'{n} x {k}':>12} {mkl:>10.1f} {ours:>10.1f} {mkl / ours:>9.2f}x")
            del weights, transposed, packed
        print(f"{rows:>5} {'step':>8} {'':>12} {total_mkl:>10.0f} {total_packed:>10.0f} {total_mkl / total_packed:>9.2f}x")


if __name__ == "__main__":
    main()
