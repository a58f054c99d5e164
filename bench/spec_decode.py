"""Speculative decoding: rayvllm and vLLM's CPU build, each without
speculation, with n-gram prompt lookup and with a draft model, on a
workload that repeats itself and on one that does not.

    python bench/spec_decode.py [--engines rayvllm,vllm] [--methods none,ngram,draft_model]
        [--preset llama25m | --model DIR [--draft DIR]] [--draft-layers 1]
        [--num-spec-tokens 4] [--num-seqs 16] [--max-tokens 128] [--tpot-trials 4]
        [--json-out FILE] [--verbose]

Model and draft: `--preset` builds a seeded random model (bench/_common.py)
and the draft is cut from it (`rayvllm/models/truncated_draft.py`: its
embeddings, first `--draft-layers` layers and LM head); `--model`/`--draft`
take real directories. Both engines get the same directories and vLLM's
`speculative_config` names: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4, "prompt_lookup_min": 2} and {"method":
"draft_model", "model": draft, "num_speculative_tokens": k}.

Workloads (the same token ids for both engines, greedy, ignore_eos,
`--max-tokens` each):
  echo    code-editing prompts that echo their input: a block of
          generated Python, then "Rewrite the code above with ... renamed:",
          then the block's first lines again (tokenized by the model's
          tokenizer), so the continuation repeats text the prompt holds.
  random  random token ids: nothing to look up.
With random weights a model does not really copy its prompt; drafts are
then accepted where its greedy output falls into loops (random models
often do), so the figures show the machinery's cost and gain, not a
trained model's acceptance. Acceptance is reported beside each row.

Figures per (engine, method, workload): output tok/s of `--num-seqs`
requests submitted together, and TPOT at batch 1 (median over
`--tpot-trials` prompts of (t(max_tokens) - t(1 token)) / (max_tokens - 1)),
the latency speculation is for. Each (engine, method) runs in its own child
process (vLLM's in the peer virtualenv, bench/setup_peers.sh) with one
warmup; the vLLM child's environment is bench/throughput.py's.
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
    PRESETS,
    CACHE_DIR,
    build_model,
    cpu_line,
    ensure_repo_on_path,
    format_table,
    load_engine,
    median,
    model_vocab_size,
    random_ids,
    run_child,
    run_child_and_exit,
    shutdown_engine,
)

ENGINES = ("rayvllm", "vllm")
METHODS = ("none", "ngram", "draft_model")
WORKLOADS = ("echo", "random")
MAX_MODEL_LEN = 1024


def spec_config(method: str, draft: str, k: int) -> dict[str, Any] | None:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return None


def echo_prompt(rng: random.Random) -> str:
    """A code-editing request whose answer repeats most of its prompt."""
    names = ["total", "count", "value", "items", "result", "index", "buffer", "offset"]
    lines = []
    for f in range(rng.randint(3, 5)):
        a, b = rng.sample(names, 2)
        lines += [f"def step_{f}({a}, {b}):", f"    {a} = {a} + {b} * {rng.randint(2, 9)}",
                  f"    return {a} - {rng.randint(1, 99)}", ""]
    code = "\n".join(lines)
    old, new = rng.sample(names, 2)
    return f"{code}\nRewrite the code above with `{old}` renamed to `{new}`:\n\n{code[: len(code) // 3]}"


def make_prompts(model: str, workload: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(f"{workload}-{seed}")
    if workload == "random":
        vocab = model_vocab_size(model)
        return [random_ids(rng, rng.randint(96, 256), vocab) for _ in range(n)]
    ensure_repo_on_path()
    from rayvllm.utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(model)
    return [tokenizer.encode(echo_prompt(rng), add_special_tokens=False)[: MAX_MODEL_LEN // 2] for _ in range(n)]


# --------------------------------------------------------------------------- #
# Child: one engine with one method, both workloads.
# --------------------------------------------------------------------------- #


def _acceptance(engine: str, llm: Any) -> dict[str, int] | None:
    """Cumulative (draft tokens, accepted tokens) from the engine's counters."""
    try:
        if engine == "rayvllm":
            stats = llm.llm_engine.engine_core.make_stats().spec_decoding_stats
            return None if stats is None else {"draft": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens}
        values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        return {"draft": int(values["vllm:spec_decode_num_draft_tokens"]),
                "accepted": int(values["vllm:spec_decode_num_accepted_tokens"])}
    except Exception:  # noqa: BLE001 - a peer without the counters reports none
        return None


def child(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.workload) as f:
        prompts: dict[str, list[list[int]]] = json.load(f)
    extra: dict[str, Any] = {}
    spec = spec_config(args.method, args.draft, args.num_spec_tokens)
    if spec is not None:
        extra["speculative_config"] = spec
    if args.child == "vllm":
        extra["disable_log_stats"] = False  # its counters, for the acceptance column
    t0 = time.perf_counter()
    llm, sampling_params, kwargs = load_engine(
        args.child, args.model, max_num_seqs=max(args.num_seqs, 1), max_num_batched_tokens=2048,
        max_model_len=MAX_MODEL_LEN, extra_kwargs=extra,
    )
    load_s = time.perf_counter() - t0

    def run(batch: list[list[int]], max_tokens: int) -> tuple[float, int]:
        params = sampling_params(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    results: dict[str, Any] = {}
    try:
        run(prompts["warmup"], 8)
        for workload in WORKLOADS:
            before = _acceptance(args.child, llm)
            seconds, tokens = run(prompts[workload], args.max_tokens)
            tpot = []
            for prompt in prompts[workload][: args.tpot_trials]:
                one, _ = run([prompt], 1)
                full, _ = run([prompt], args.max_tokens)
                tpot.append((full - one) / (args.max_tokens - 1))
            after = _acceptance(args.child, llm)
            accepted = None
            if before is not None and after is not None:
                accepted = {k: after[k] - before[k] for k in after}
            results[workload] = {"tok_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds,
                                 "tpot_s": median(tpot), "acceptance": accepted}
    finally:
        shutdown_engine(llm)
    module = sys.modules[type(llm).__module__.split(".")[0]]
    return {"load_s": load_s, "version": getattr(module, "__version__", "dev"), "engine_kwargs": kwargs,
            "workloads": results}


# --------------------------------------------------------------------------- #
# Parent
# --------------------------------------------------------------------------- #


def _row(engine: str, method: str, payload: dict[str, Any]) -> list[list[str]]:
    if "error" in payload:
        return [[engine, method, "-", "-", "-", "-", "error: " + str(payload["error"])[:100]]]
    rows = []
    for workload, r in payload["workloads"].items():
        acc = r.get("acceptance")
        rate = f"{acc['accepted']}/{acc['draft']}" if acc and acc["draft"] else "-"
        rows.append([engine, method, workload, f"{r['tok_s']:.1f}", f"{1000 * r['tpot_s']:.2f}", rate, ""])
    return rows


def speedup_rows(results: dict[str, Any], engines: list[str], methods: list[str]) -> list[list[str]]:
    """Per speculation method and workload: each engine's TPOT and
    throughput against its own run without speculation (below 1 for TPOT is
    a gain), and, when both engines ran, rayvllm's TPOT against vLLM's with
    the same method. Needs `none` among the methods; a missing or failed run
    is "-"."""

    def figure(engine: str, method: str, workload: str, key: str) -> float | None:
        got = results.get(f"{engine}/{method}", {}).get("workloads", {}).get(workload)
        return None if got is None else got[key]

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"

    if "none" not in methods:
        return []
    rows = []
    for method in (m for m in methods if m != "none"):
        for workload in WORKLOADS:
            rows.append([
                method, workload,
                *(ratio(figure(e, method, workload, "tpot_s"), figure(e, "none", workload, "tpot_s")) for e in engines),
                *(ratio(figure(e, method, workload, "tok_s"), figure(e, "none", workload, "tok_s")) for e in engines),
                *([ratio(figure("rayvllm", method, workload, "tpot_s"), figure("vllm", method, workload, "tpot_s"))]
                  if len(engines) == 2 else []),
            ])
    return rows


def parent(args: argparse.Namespace) -> None:
    engines = [e for e in args.engines.split(",") if e]
    methods = [m for m in args.methods.split(",") if m]
    bad = [x for x in engines if x not in ENGINES] + [x for x in methods if x not in METHODS]
    if bad:
        raise SystemExit(f"unknown engine or method {bad}; engines {ENGINES}, methods {METHODS}")
    model = str(args.model or build_model(None, args.preset))
    draft = args.draft
    if draft is None and "draft_model" in methods:
        ensure_repo_on_path()
        from rayvllm.models.truncated_draft import build_truncated_draft

        draft = str(build_truncated_draft(model, CACHE_DIR / f"{Path(model).name}-draft{args.draft_layers}",
                                          args.draft_layers))
    prompts = {w: make_prompts(model, w, args.num_seqs, args.seed) for w in WORKLOADS}
    prompts["warmup"] = make_prompts(model, "random", 2, args.seed + 1)
    print(f"model {model}; draft {draft}; k={args.num_spec_tokens}; {args.num_seqs} requests x "
          f"{args.max_tokens} tokens per workload; {cpu_line()}", flush=True)
    rows: list[list[str]] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rayvllm-spec-") as tmp:
        path = os.path.join(tmp, "prompts.json")
        with open(path, "w") as f:
            json.dump(prompts, f)
        for engine in engines:
            python, env = sys.executable, {}
            if engine == "vllm":
                from throughput import _parse_env, vllm_env

                python, env = args.vllm_python, vllm_env(_parse_env(args.vllm_env))
            for method in methods:
                print(f"running {engine} / {method} ...", flush=True)
                if not os.path.exists(python):
                    payload: dict[str, Any] = {"error": f"{python} missing; run bench/setup_peers.sh"}
                else:
                    argv = [python, str(Path(__file__).resolve()), "--child", engine, "--method", method,
                            "--workload", path, "--model", model, "--draft", draft or "",
                            "--num-spec-tokens", str(args.num_spec_tokens), "--num-seqs", str(args.num_seqs),
                            "--max-tokens", str(args.max_tokens), "--tpot-trials", str(args.tpot_trials)]
                    got = run_child(argv, env=env, timeout=args.timeout, echo=args.verbose, prefix=f"[{engine}] ")
                    payload = dict(got.payload or {})
                    err = got.error()
                    if err:
                        payload["error"] = err
                results[f"{engine}/{method}"] = payload
                rows += _row(engine, method, payload)
    print()
    print(format_table(["engine", "speculation", "workload", "output tok/s", "TPOT ms (batch 1)",
                        "accepted/drafted", "notes"], rows))
    speedups = speedup_rows(results, engines, methods)
    if speedups:
        print()
        print(format_table(["speculation", "workload", *(f"{e} TPOT / TPOT without" for e in engines),
                            *(f"{e} tok/s / tok/s without" for e in engines),
                            *(["TPOT rayvllm / vLLM"] if len(engines) == 2 else [])], speedups))
    vllm_errors = [m for m in methods if m != "none" and "error" in results.get(f"vllm/{m}", {})]
    if "vllm" in engines and vllm_errors:
        print(f"vLLM's CPU build did not run speculation {vllm_errors} here; see the errors above.")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": model, "draft": draft, "cpu": cpu_line(),
                                                   "results": results}, indent=2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    p.add_argument("--draft", default=None, help="draft model dir (default: cut from the model)")
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--num-spec-tokens", type=int, default=4)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tpot-trials", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child")
    p.add_argument("--json-out", default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result-out", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    ns = build_parser().parse_args()
    if ns.child:
        run_child_and_exit({"engine": ns.child, "method": ns.method}, lambda: child(ns), ns.result_out)
    else:
        parent(ns)
