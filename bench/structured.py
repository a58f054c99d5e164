"""Offline throughput with structured outputs: a JSON schema on every
request, against the same workload unconstrained.

    python bench/structured.py [--num-seqs 64] [--min-len 32] [--max-len 256]
        [--preset llama25m | --model DIR] [--seed 0] [--repeats 1] [--json-out FILE]

Workload: `--num-seqs` prompts of random token ids (bench/_common.py's
shape), each sampled at temperature 1 with its own seed under `SCHEMA`
(bounded: every output ends within max_tokens = the request's drawn
length unless cut) with `max_tokens` drawn as throughput.py does. The
constrained round runs first; the unconstrained round then asks each
request for exactly as many tokens as its constrained run produced
(ignore_eos), so both rounds generate the same token counts from the same
prompts and the ratio of their times is the cost of the grammar: compiles
(one schema, cached after the first), bitmask fills (on the grammar thread,
overlapping the forward) and the mask applied in the sampler. Each round
is timed `--repeats` times (fresh ids); medians are reported. Both modes
run in one engine, after one warmup of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PRESETS,
    BenchRequest,
    build_model,
    cpu_line,
    ensure_repo_on_path,
    format_table,
    make_requests,
    make_warmup,
    median,
    model_vocab_size,
)

# Objects of a few bounded fields: long enough that masks are filled for
# many steps, bounded so that every request ends with its grammar.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"type": "string", "enum": ["person", "place", "thing"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "tags", "active"],
}


def _run(llm: Any, reqs: list[BenchRequest], params: list[Any]) -> tuple[float, list[int]]:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [len(o.outputs[0].token_ids) for o in outs]


def main(args: argparse.Namespace) -> dict[str, Any]:
    ensure_repo_on_path()
    from rayvllm import LLM, SamplingParams, StructuredOutputsParams

    model = args.model or str(build_model(None, args.preset))
    vocab = model_vocab_size(model)
    rounds = make_requests(args.num_seqs, args.min_len, args.max_len, vocab, args.seed, args.repeats)
    so = StructuredOutputsParams(json=SCHEMA)
    llm = LLM(model=model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_len * 2 + 16, seed=args.seed)
    try:
        warmup = make_warmup(vocab, args.seed)
        _run(llm, warmup, [SamplingParams(max_tokens=r.max_tokens, structured_outputs=so) for r in warmup])
        _run(llm, warmup, [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in warmup])
        constrained, free, tokens = [], [], []
        for reqs in rounds:
            params = [
                SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=r.max_tokens, structured_outputs=so)
                for i, r in enumerate(reqs)
            ]
            seconds, lengths = _run(llm, reqs, params)
            constrained.append(seconds)
            same = [SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=n, ignore_eos=True)
                    for i, n in enumerate(lengths)]
            seconds, free_lengths = _run(llm, reqs, same)
            assert free_lengths == lengths
            free.append(seconds)
            tokens.append(sum(lengths))
    finally:
        llm.shutdown()
    result = {
        "cpu": cpu_line(),
        "model": model,
        "num_seqs": args.num_seqs,
        "output_tokens": tokens,
        "constrained_s": median(constrained),
        "unconstrained_s": median(free),
        "constrained_tok_s": median(tokens) / median(constrained),
        "unconstrained_tok_s": median(tokens) / median(free),
    }
    result["slowdown"] = result["constrained_s"] / result["unconstrained_s"] - 1.0
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    p.add_argument("--json-out", default=None)
    return p


if __name__ == "__main__":
    ns = build_parser().parse_args()
    res = main(ns)
    print(res["cpu"])
    print(format_table(
        ["mode", "output tokens", "seconds", "tok/s"],
        [
            ["json schema", str(median(res["output_tokens"])), f"{res['constrained_s']:.2f}",
             f"{res['constrained_tok_s']:.1f}"],
            ["unconstrained", str(median(res["output_tokens"])), f"{res['unconstrained_s']:.2f}",
             f"{res['unconstrained_tok_s']:.1f}"],
        ],
    ))
    print(f"slowdown with the schema: {100 * res['slowdown']:+.1f}%")
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(res, indent=2))
