"""Decode on a sliding-window model: a context 4x the window against a
context equal to it (issue 59: the longer one must be no slower, which is
the point of the window), and the same model without its window.

    python bench/window_decode.py [--window 512] [--batch 8] [--steps 20]
        [--warmup-steps 5] [--repeats 3] [--json-out FILE]

Models: bench/_common.py's llama25m shape as a random Mistral with
`sliding_window` = `--window` on every layer, and its twin without the
window (same seed, same weights). One in-process `rayvllm.LLM` per model,
float32 on the CPU as the README serves it, prefix caching off. A run:
`--batch` fresh sequences of `context` random prompt ids, greedy; the
model runner's steps that decode exactly the batch and nothing else are
timed (bench/decode_roofline.py's timer), `--warmup-steps` dropped, the
median of the next `--steps` kept. Each model runs both contexts, in
alternating order across `--repeats`; the table gives the median of the
repeats' medians and their spread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import CACHE_DIR, PRESETS, cpu_line, format_table, load_engine, median, shutdown_engine  # noqa: E402
from decode_roofline import DecodeTimer, time_decode  # noqa: E402

_MODEL_SHAPE = "llama25m"


def build_models(window: int, max_len: int) -> dict[str, Path]:
    """The windowed random Mistral and its windowless twin (built once, cached)."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    shape = {k: v for k, v in PRESETS[_MODEL_SHAPE].items() if k not in ("arch", "max_position_embeddings")}
    models = {}
    for name, extra in (("windowed", {"sliding_window": window}), ("full", {})):
        spec = RandomModelSpec(arch="mistral", max_position_embeddings=max_len, extra=extra, **shape)
        models[name] = build_random_model(CACHE_DIR / f"bench-window-{name}-{window}-{max_len}", spec)
    return models


def decode_step_ms(model: Path, contexts: list[int], args: argparse.Namespace) -> dict[int, list[float]]:
    """Per context: each repeat's median pure-decode step, in ms."""
    import torch

    max_tokens = args.warmup_steps + args.steps + 16
    llm, sampling_params, _ = load_engine(
        "rayvllm", str(model), max_num_seqs=args.batch, max_num_batched_tokens=4096,
        max_model_len=max(contexts) + max_tokens, enable_prefix_caching=False,
    )
    found: dict[int, list[float]] = {c: [] for c in contexts}
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.runner
        timer = DecodeTimer(runner, torch.device("cpu"))
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        for repeat in range(args.repeats):
            for context in contexts if repeat % 2 == 0 else contexts[::-1]:
                run_args = argparse.Namespace(
                    context_len=context, seed=f"{args.seed}-{repeat}-{context}", warmup_steps=args.warmup_steps,
                    steps=args.steps, profile_out=None,
                )
                steps = time_decode(llm, sampling_params, timer, args.batch, max_tokens, vocab, run_args)
                found[context].append(median([s.seconds for s in steps]) * 1e3)
    finally:
        shutdown_engine(llm)
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    contexts = [args.window, 4 * args.window]
    models = build_models(args.window, 4 * args.window + args.warmup_steps + args.steps + 64)
    results = {name: decode_step_ms(path, contexts, args) for name, path in models.items()}
    rows = []
    for name, by_context in results.items():
        for context, values in by_context.items():
            rows.append([name, str(context), f"{median(values):.2f}", f"{min(values):.2f}-{max(values):.2f}"])
    windowed = results["windowed"]
    ratio = median(windowed[contexts[1]]) / median(windowed[contexts[0]])
    print(f"{cpu_line()}\nrandom Mistral ({_MODEL_SHAPE} shape), window {args.window}, batch {args.batch}, "
          f"float32; median of {args.steps} pure decode steps after {args.warmup_steps}, {args.repeats} repeats\n")
    print(format_table(["model", "context", "step ms (median)", "spread"], rows))
    verdict = "met" if ratio <= 1.0 else "NOT met"
    print(f"\ntarget: windowed decode at context {contexts[1]} no slower than at {contexts[0]}: "
          f"{ratio:.3f}x, {verdict}")
    return {"cpu": cpu_line(), "window": args.window, "batch": args.batch, "step_ms": results, "ratio": ratio}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=512, help="the model's sliding window; contexts are 1x and 4x it")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=20, help="timed pure decode steps per run (median kept)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs per model and context, orders alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p


def main() -> None:
    args = build_parser().parse_args()
    summary = run(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
