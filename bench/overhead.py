"""Per-step engine overhead: a model whose forward costs almost nothing (issue 3).

    python bench/overhead.py [--engines inproc,ray,vllm] [--seqs 1,16,64,256]
        [--output-len 128] [--repeats 1] [--model DIR] [--json-out FILE]

Model: the "tiny" preset of bench/_common.py (Llama, 2 layers, hidden 128,
vocab 4096, float32), built once under ~/.cache/rayvllm/bench-tiny. Its
forward is so cheap that step time is mostly scheduling, input preparation,
sampling, output processing and, for Ray, the actor round trips.

Workload, for each N in --seqs: N requests of random token ids (prompt
lengths uniform in [--min-prompt, --max-prompt]), greedy, ignore_eos, exactly
--output-len output tokens each, max_num_seqs = N and a token budget that
prefills all N prompts in one step, so all N sequences decode together for the
whole run. Warmup first: N requests of --max-prompt tokens and a few output
tokens (same batch shape, so compilation and first-touch costs stay out of
the timing). With --repeats R each (engine, N) runs R timed rounds with fresh
ids (the prefix cache never hits) and reports the median round.

Engines, each (engine, N) in its own subprocess so that one engine's threads,
Ray processes or vLLM engine core cannot disturb the next, and die with it:
  inproc  rayvllm.LLM, default in-process executor.
  ray     rayvllm.LLM(distributed_executor_backend="ray"), TP=1.
  ray-async  the same with async_scheduling=True.
  vllm    vLLM's CPU build in the peer virtualenv (bench/setup_peers.sh),
          float32, with bench/throughput.py's vLLM environment
          (VLLM_CPU_NUM_OF_RESERVED_CPU=0 etc.; see its --help). Each child
          compiles the model again on start (~1-2 min on 2 cores), so vLLM
          costs minutes per N.
A failing engine gets its error in its table row; the run goes on.

Every engine runs each round through `LLM.generate`; step time is round
seconds / --output-len for all of them (one step per output token once all
prompts prefill in one step; vLLM's offline API hides its steps, and an
engine whose steps may end without telling the caller has no per-call step).

Targets named by the issues, printed under the table: ray / inproc output
tok/s at N=64 >= 0.95, and inproc / vllm at N=64 >= 1.0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    BenchRequest,
    Workload,
    build_model,
    count_output_tokens,
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
from throughput import _note, _parse_env, _timed_rounds, vllm_env  # noqa: E402

# Engine name -> (load_engine's engine, extra LLM kwargs).
ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "inproc": ("rayvllm", {}),
    "ray": ("rayvllm", {"distributed_executor_backend": "ray"}),
    # The Ray path with async scheduling (off by default where the
    # SchedulerActor hosts the one worker), for before/after.
    "ray-async": ("rayvllm", {"distributed_executor_backend": "ray", "async_scheduling": True}),
    "vllm": ("vllm", {}),
}

# (numerator engine, denominator engine, minimum tok/s ratio), all at TARGET_SEQS.
TARGETS: tuple[tuple[str, str, float], ...] = (("ray", "inproc", 0.95), ("inproc", "vllm", 1.0))
TARGET_SEQS = 64

# Enough output tokens to reach the decode batch shape, few enough to keep warmup short.
WARMUP_OUTPUT_TOKENS = 8


# --------------------------------------------------------------------------- #
# Children: one engine at one N each.
# --------------------------------------------------------------------------- #


def _prompts_and_params(reqs: list[BenchRequest], sampling_params: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [sampling_params(temperature=0.0, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
    return prompts, params


def _load(engine: str, model: str, workload: Workload, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    base, extra = ENGINES[engine]
    return load_engine(
        base,
        model,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        enable_prefix_caching=workload.enable_prefix_caching,
        vllm_eager=args.vllm_eager,
        extra_kwargs=extra,
    )


def child_engine(engine: str, model: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """`LLM.generate` over each round's requests, the same call for every engine."""
    llm, sampling_params, kwargs = _load(engine, model, workload, args)

    def generate(reqs: list[BenchRequest]) -> int:
        prompts, params = _prompts_and_params(reqs, sampling_params)
        return count_output_tokens(llm.generate(prompts, params, use_tqdm=False))

    try:
        result = _timed_rounds(generate, workload)
    finally:
        shutdown_engine(llm)
    result.update(engine_kwargs=kwargs)
    return result


def _summarise_steps(result: dict[str, Any], output_len: int) -> None:
    """The step time the parent's table reads: one engine step per output
    token once every prompt is in (the only step count vLLM's API shows)."""
    for rnd in result["rounds"]:
        rnd["step_ms"] = 1e3 * rnd["seconds"] / output_len
    result["step_ms"] = median([r["step_ms"] for r in result["rounds"]])


def child_main(args: argparse.Namespace) -> None:
    workload = Workload.load(args.workload)

    def work() -> dict[str, Any]:
        import torch

        result = child_engine(args.child, args.model, workload, args)
        _summarise_steps(result, int(workload.extra["output_len"]))
        module = sys.modules["vllm" if args.child == "vllm" else "rayvllm"]
        result.update(
            version=getattr(module, "__version__", "dev"),
            torch_threads=torch.get_num_threads(),
            env={k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))},
        )
        return result

    run_child_and_exit({"engine": args.child, "num_seqs": workload.max_num_seqs}, work, args.result_out)


# --------------------------------------------------------------------------- #
# Parent: one workload per N, every engine's child on it, one table.
# --------------------------------------------------------------------------- #


def _parse_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise SystemExit(f"{what} is empty")
    return items


def make_workload(num_seqs: int, args: argparse.Namespace, vocab: int, max_model_len: int) -> Workload:
    # make_requests also draws output lengths; the fixed --output-len replaces them.
    drawn = make_requests(num_seqs, args.min_prompt, args.max_prompt, vocab, args.seed, args.repeats)
    rounds = [[BenchRequest(r.prompt_token_ids, args.output_len) for r in rnd] for rnd in drawn]
    warmup = make_warmup(
        vocab,
        args.seed,
        num=num_seqs,
        prompt_len=args.max_prompt,
        max_tokens=min(WARMUP_OUTPUT_TOKENS, args.output_len),
    )
    return Workload(
        warmup=warmup,
        rounds=rounds,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, num_seqs * args.max_prompt),
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        extra={"output_len": args.output_len},
    )


def run_engine(engine: str, model: str, workload_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One (engine, N) child; returns its payload, with "error" set when it failed."""
    if engine == "vllm":
        python, env = args.vllm_python, vllm_env(_parse_env(args.vllm_env))
        if not os.path.exists(python):
            return {"engine": engine, "error": f"{python} missing; run bench/setup_peers.sh"}
    else:
        python, env = sys.executable, {}
    argv = [python, str(Path(__file__).resolve()), "--child", engine, "--workload", workload_path, "--model", model]
    if args.vllm_eager:
        argv.append("--vllm-eager")
    child = run_child(argv, env=env, timeout=args.timeout, echo=args.verbose, prefix=f"[{engine}] ")
    payload = dict(child.payload or {"engine": engine})
    err = child.error()
    if err:
        payload["error"] = err
        if not args.verbose:
            sys.stderr.write(f"[{engine}] failed; last output:\n" + "\n".join(child.log_tail[-15:]) + "\n")
    return payload


def _one_line(text: str) -> str:
    # Errors such as Ray's ActorDiedError span lines; a table cell cannot.
    return " ".join(text.split())


def _ratio(results: dict[tuple[int, str], dict[str, Any]], n: int, num: str, den: str) -> float | str:
    """tok/s of `num` over `den` at N=n, or why there is none."""
    for engine in (num, den):
        p = results.get((n, engine))
        if p is None:
            return f"{engine} not run at N={n}"
        if "error" in p:
            return f"{engine} failed: {_one_line(p['error'])[:100]}"
    return results[(n, num)]["tok_s"] / results[(n, den)]["tok_s"]


def print_report(
    results: dict[tuple[int, str], dict[str, Any]], seqs: list[int], engines: list[str], args: argparse.Namespace
) -> None:
    rows = []
    for n in seqs:
        for engine in engines:
            p = results[(n, engine)]
            if "error" in p:
                rows.append([str(n), engine, "-", "-", "-", "error: " + _one_line(p["error"])[:120]])
                continue
            ratio = _ratio(results, n, engine, "inproc")
            rows.append([
                str(n),
                engine,
                f"{p['tok_s']:.1f}",
                f"{p['step_ms']:.2f}",
                f"{ratio:.2f}x" if isinstance(ratio, float) else "-",
                _note(engine, p),
            ])
    print()
    print(format_table(["N", "engine", "output tok/s", "step ms", "vs inproc", "notes"], rows))
    print(
        f"(N running sequences, {args.output_len} output tokens each; median of {args.repeats} round(s); "
        f"step ms: round seconds / {args.output_len} output tokens, every engine alike; "
        f"'vs inproc' = tok/s / inproc tok/s; {platform.machine()}, {os.cpu_count()} CPUs)"
    )
    print()
    for num, den, target in TARGETS:
        if num not in engines and den not in engines:
            continue
        ratio = _ratio(results, TARGET_SEQS, num, den)
        head = f"{num} / {den} output tok/s at N={TARGET_SEQS} (target >= {target}): "
        if isinstance(ratio, float):
            print(head + f"{ratio:.2f}x, " + ("met" if ratio >= target else "NOT met"))
        else:
            print(head + "n/a, " + ratio)


def parent_main(args: argparse.Namespace) -> None:
    engines = _parse_list(args.engines, "--engines")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    try:
        seqs = [int(s) for s in _parse_list(args.seqs, "--seqs")]
    except ValueError:
        raise SystemExit(f"--seqs wants comma-separated integers, got {args.seqs!r}") from None
    if min(seqs) < 1 or args.output_len < 1 or args.repeats < 1:
        raise SystemExit("--seqs entries, --output-len and --repeats must be >= 1")
    model = str(args.model or build_model(None, "tiny"))
    vocab = model_vocab_size(model)
    with open(Path(model) / "config.json") as f:
        max_model_len = int(json.load(f).get("max_position_embeddings", 2048))
    if args.max_prompt + args.output_len > max_model_len:
        raise SystemExit(
            f"a request needs {args.max_prompt + args.output_len} positions; the model has {max_model_len}"
        )
    print(
        f"model {model}\nN in {seqs}; prompts {args.min_prompt}-{args.max_prompt} tokens, {args.output_len} output "
        f"tokens each; engines {', '.join(engines)}; {args.repeats} timed round(s)",
        flush=True,
    )

    results: dict[tuple[int, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rayvllm-bench-") as tmp:
        # N outside, engines inside: the runs a ratio compares sit close together in time.
        for n in seqs:
            workload_path = os.path.join(tmp, f"workload-{n}.json")
            make_workload(n, args, vocab, max_model_len).save(workload_path)
            for engine in engines:
                print(f"N={n} {engine} ...", flush=True)
                results[(n, engine)] = run_engine(engine, model, workload_path, args)

    print_report(results, seqs, engines, args)
    if args.json_out:
        summary = {
            "model": model,
            "seqs": seqs,
            "output_len": args.output_len,
            "prompt_len": [args.min_prompt, args.max_prompt],
            "seed": args.seed,
            "repeats": args.repeats,
            "cpu_count": os.cpu_count(),
            "results": [results[(n, e)] for n in seqs for e in engines],
        }
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.json_out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    p.add_argument("--seqs", default="1,16,64,256", help="comma-separated numbers of running sequences")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds per engine and N (fresh ids); median reported")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget per step; raised to N x --max-prompt so the prefill takes one step")
    p.add_argument("--model", default=None, help="model dir (default: tiny preset in ~/.cache/rayvllm)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="env for the vLLM child")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per (engine, N) child")
    p.add_argument("--verbose", action="store_true", help="stream each child's output")
    # Child-only arguments (set by the parent).
    p.add_argument("--child", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--result-out", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
