"""What prefix caching costs when it never hits, and what it saves when it does.

    python bench/prefix_cache.py [--part both|overhead|ttft] [--engine rayvllm|vllm]
        [--model DIR] [--json-out FILE]

(a) overhead: offline throughput (bench/throughput.py's workload: 64 random
    requests, lengths 32-256) with enable_prefix_caching on and off. Prompts
    are distinct random ids, so the hit rate is 0%: any difference is the cost
    of hashing blocks and keeping the cache. Each setting runs in its own
    subprocess; `--trials` alternates on/off (and which goes first) to spread
    machine noise over both. The verdict compares the best rounds (other load
    only slows rounds down); medians are shown too. Target: caching on costs
    at most 2%.

(b) TTFT: with caching on, then off (one subprocess each), per trial: a fresh
    512-token random prefix; request A = prefix + 16 random tokens runs to
    completion (max_tokens=1); then request B = prefix + 16 other tokens, and
    we time B's first token: the wall time of `generate` with max_tokens=1
    (and, where the engine fills it, RequestOutput.metrics.first_token_time -
    arrival_time). With caching on, B should only compute its suffix.
    Target: off/on >= 5x.

`--engine vllm` runs the same against the peer vLLM (bench/setup_peers.sh)
for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    Workload,
    build_model,
    run_child_and_exit,
    format_table,
    load_engine,
    make_requests,
    make_warmup,
    median,
    model_vocab_size,
    random_ids,
    run_child,
    shutdown_engine,
)

THROUGHPUT_SCRIPT = Path(__file__).resolve().parent / "throughput.py"


# --------------------------------------------------------------------------- #
# TTFT child
# --------------------------------------------------------------------------- #


def _ttft_of(output: Any) -> float | None:
    metrics = getattr(output, "metrics", None)
    first = getattr(metrics, "first_token_time", None)
    arrival = getattr(metrics, "arrival_time", None)
    if first is None or arrival is None:
        return None
    return float(first - arrival)


def ttft_child(args: argparse.Namespace) -> dict[str, Any]:
    caching = args.caching == "on"
    llm, sampling_params, kwargs = load_engine(
        args.engine,
        args.model,
        max_model_len=args.max_model_len,
        enable_prefix_caching=caching,
        vllm_eager=args.vllm_eager,
    )
    vocab = model_vocab_size(args.model)
    one = sampling_params(temperature=0.0, ignore_eos=True, max_tokens=1)

    def first_token(ids: list[int]) -> tuple[float, float | None]:
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids}], [one], use_tqdm=False)
        wall = time.perf_counter() - t0
        if len(outputs[0].outputs[0].token_ids) != 1:
            raise RuntimeError("expected exactly one output token")
        return wall, _ttft_of(outputs[0])

    rng = random.Random(f"ttft-{args.seed}")
    walls: list[float] = []
    metrics: list[float | None] = []
    try:
        # Warmup at the same shape, with its own prefix, so the first trial is not cold.
        for _ in range(2):
            first_token(random_ids(rng, args.prefix_len + args.suffix_len, vocab))
        for _ in range(args.ttft_trials):
            prefix = random_ids(rng, args.prefix_len, vocab)
            first_token(prefix + random_ids(rng, args.suffix_len, vocab))  # request A: fills the cache
            wall, metric = first_token(prefix + random_ids(rng, args.suffix_len, vocab))  # request B: timed
            walls.append(wall)
            metrics.append(metric)
    finally:
        shutdown_engine(llm)
    filled = [m for m in metrics if m is not None]
    return {
        "caching": args.caching,
        "ttft_s": median(walls),
        "metrics_ttft_s": median(filled) if filled and len(filled) == len(walls) else None,
        "trials": [{"wall_s": w, "metrics_ttft_s": m} for w, m in zip(walls, metrics)],
        "engine_kwargs": kwargs,
    }


# --------------------------------------------------------------------------- #
# Parent
# --------------------------------------------------------------------------- #


def _engine_python_env(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    if args.engine == "vllm":
        from throughput import _parse_env, vllm_env

        return args.vllm_python, vllm_env(_parse_env(args.vllm_env))
    return sys.executable, {}


def _check(payload: dict[str, Any] | None, err: str | None, what: str) -> dict[str, Any]:
    if err or payload is None:
        raise RuntimeError(f"{what}: {err}")
    return payload


def overhead_part(args: argparse.Namespace, model: str, tmp: str) -> dict[str, Any]:
    vocab = model_vocab_size(model)
    rounds = make_requests(args.num_seqs, args.min_len, args.max_len, vocab, args.seed, args.repeats)
    python, env = _engine_python_env(args)
    paths = {}
    for setting in ("on", "off"):
        wl = Workload(
            warmup=make_warmup(vocab, args.seed),
            rounds=rounds,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=setting == "on",
        )
        paths[setting] = os.path.join(tmp, f"workload-{setting}.json")
        wl.save(paths[setting])
    tok_s: dict[str, list[float]] = {"on": [], "off": []}
    for trial in range(args.trials):
        order = ("on", "off") if trial % 2 == 0 else ("off", "on")
        for setting in order:
            print(f"overhead trial {trial + 1}/{args.trials}: caching {setting} ...", flush=True)
            argv = [python, str(THROUGHPUT_SCRIPT), "--child", args.engine, "--workload", paths[setting],
                    "--model", model]
            if args.vllm_eager:
                argv.append("--vllm-eager")
            child = run_child(argv, env=env, timeout=args.timeout, echo=args.verbose, prefix=f"[{setting}] ")
            payload = _check(child.payload, child.error(), f"caching {setting}")
            tok_s[setting].extend(r["tok_s"] for r in payload["rounds"])
    # Other load on the machine only ever slows a round down, so the best
    # rounds are the least noisy comparison; medians are kept alongside.
    on, off = max(tok_s["on"]), max(tok_s["off"])
    med_on, med_off = median(tok_s["on"]), median(tok_s["off"])
    return {
        "tok_s_on": on,
        "tok_s_off": off,
        "cost": 1.0 - on / off,
        "median_tok_s_on": med_on,
        "median_tok_s_off": med_off,
        "median_cost": 1.0 - med_on / med_off,
        "all_tok_s": tok_s,
    }


def ttft_part(args: argparse.Namespace, model: str) -> dict[str, Any]:
    python, env = _engine_python_env(args)
    out: dict[str, Any] = {}
    for setting in ("on", "off"):
        print(f"ttft: caching {setting} ...", flush=True)
        argv = [python, str(Path(__file__).resolve()), "--child", "ttft", "--caching", setting,
                "--engine", args.engine, "--model", model, "--seed", str(args.seed),
                "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len),
                "--ttft-trials", str(args.ttft_trials), "--max-model-len", str(args.max_model_len)]
        if args.vllm_eager:
            argv.append("--vllm-eager")
        child = run_child(argv, env=env, timeout=args.timeout, echo=args.verbose, prefix=f"[{setting}] ")
        out[setting] = _check(child.payload, child.error(), f"ttft caching {setting}")
    out["speedup"] = out["off"]["ttft_s"] / out["on"]["ttft_s"]
    return out


def parent_main(args: argparse.Namespace) -> None:
    model = str(args.model or build_model(None, "llama25m"))
    print(f"engine {args.engine}, model {model}", flush=True)
    report: dict[str, Any] = {"engine": args.engine, "model": model}
    rows: list[list[str]] = []
    with tempfile.TemporaryDirectory(prefix="rayvllm-prefix-") as tmp:
        if args.part in ("both", "overhead"):
            try:
                o = overhead_part(args, model, tmp)
                report["overhead"] = o
                verdict = "ok" if o["cost"] <= 0.02 else "over the 2% target"
                rows.append(["throughput, 0% hits (best round)", f"{o['tok_s_on']:.1f} tok/s",
                             f"{o['tok_s_off']:.1f} tok/s", f"cost {100 * o['cost']:+.1f}%", verdict])
                rows.append(["throughput, 0% hits (median)", f"{o['median_tok_s_on']:.1f} tok/s",
                             f"{o['median_tok_s_off']:.1f} tok/s", f"cost {100 * o['median_cost']:+.1f}%", ""])
            except RuntimeError as exc:
                report["overhead"] = {"error": str(exc)}
                rows.append(["throughput, 0% hits", "-", "-", "-", f"error: {str(exc)[:120]}"])
        if args.part in ("both", "ttft"):
            try:
                t = ttft_part(args, model)
                report["ttft"] = t
                verdict = "ok" if t["speedup"] >= 5.0 else "under the 5x target"
                rows.append([f"TTFT, {args.prefix_len}-token shared prefix + {args.suffix_len}",
                             f"{1000 * t['on']['ttft_s']:.1f} ms", f"{1000 * t['off']['ttft_s']:.1f} ms",
                             f"speedup {t['speedup']:.1f}x", verdict])
            except RuntimeError as exc:
                report["ttft"] = {"error": str(exc)}
                rows.append(["TTFT, shared prefix", "-", "-", "-", f"error: {str(exc)[:120]}"])
    print()
    print(format_table(["measure", "caching on", "caching off", "effect", "target"], rows))
    print(f"(throughput: best and median of {args.trials} x {args.repeats} rounds each; "
          f"TTFT: median wall time of {args.ttft_trials} max_tokens=1 generate calls)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json_out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["both", "overhead", "ttft"], default="both")
    p.add_argument("--engine", choices=["rayvllm", "vllm"], default="rayvllm")
    p.add_argument("--model", default=None, help="model dir (default: llama25m preset in ~/.cache/rayvllm)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per overhead child")
    p.add_argument("--trials", type=int, default=2, help="on/off child pairs for the overhead part")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--ttft-trials", type=int, default=5)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--verbose", action="store_true", help="stream each child's output")
    # Child-only arguments (set by the parent).
    p.add_argument("--child", choices=["ttft"], help=argparse.SUPPRESS)
    p.add_argument("--caching", choices=["on", "off"], help=argparse.SUPPRESS)
    p.add_argument("--result-out", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if not args.child:
        parent_main(args)
        return
    run_child_and_exit({"child": args.child}, lambda: ttft_child(args), args.result_out)


if __name__ == "__main__":
    main()
