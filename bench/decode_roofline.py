"""Decode-step time against the memory-bandwidth floor (issue 5).

    python bench/decode_roofline.py [--preset qwen3-0.6b | --model DIR]
        [--device cuda] [--dtype bfloat16] [--batch-sizes 64,256]
        [--context-len 512] [--steps 50] [--warmup-steps 10]
        [--enforce-eager] [--copy-mib 1024] [--json-out FILE] [--profile-out FILE]

The issue's run on an H100 (CUDA graphs on, then eager to compare):

    python bench/decode_roofline.py --device cuda --preset qwen3-0.6b
    python bench/decode_roofline.py --device cuda --preset qwen3-0.6b --enforce-eager

Smoke test on the CPU (the figures there are informational only):

    python bench/decode_roofline.py --preset tiny --device cpu \\
        --batch-sizes 2,4 --context-len 16 --steps 3 --warmup-steps 1

Method. One in-process `rayvllm.LLM` (no Ray: all parallel sizes 1) with
max_num_seqs = the largest B, prefix caching off and max_model_len just
above what the run needs. For each B: B requests of `--context-len` random
prompt ids, greedy, ignore_eos, driven through `llm.llm_engine.step()`.
The model runner's `execute_model` is wrapped with a timer: a step counts
only when it decodes exactly B sequences and nothing else (so the
chunked-prefill steps before, which also decode early finishers, do not),
with `torch.cuda.synchronize` on both sides of the timed call. After
`--warmup-steps` such steps, the median of the next `--steps` is the step
time; then the requests are aborted. The step time is the runner's whole
step: host input preparation, the forward (a CUDA graph replay unless
eager), logits and greedy sampling, and the sampled ids' copy to the host.

Floor. Bytes a decode step must read at least once, over the measured copy
bandwidth:
  weights   every parameter of the checkpoint's architecture in the run's
            dtype, except an untied input embedding (a step gathers only B
            of its rows); a tied embedding counts once, as the LM head.
  KV cache  K and V of every context token of every sequence in every layer
            (the engine's own per-block KV size / block size), at the mean
            context of the timed steps (it grows by one per step).
Activations, the new K/V writes and the logits are left out, so the floor
is a lower bound. Bandwidth: one `--copy-mib` device tensor copied into
another, (bytes read + bytes written) / time, median of 10 windows of 5
copies: on a GPU the device-to-device copy bandwidth, on a CPU memcpy's.

On a CPU the floor is the larger of that and the compute floor (issue 14):
2 x (the weights above, in parameters) x B FLOPs at the float32 GEMM peak
measured here (the best of a few large `torch.mm` products, both cores),
since at tens of rows a CPU decode step is bound by arithmetic, not by
reading the weights. The table names which bound applies.

Targets named by the issue, printed under the table: decode steps at batch
64-256 within 1.6x of the floor (at least ~60% of the roofline), with CUDA
graphs. A verdict on a CPU, in eager mode or at another B is informational.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    PRESETS,
    build_model,
    cpu_line,
    default_dtype,
    format_table,
    load_engine,
    median,
    model_vocab_size,
    random_ids,
    shutdown_engine,
)

# Issue 5: decode step / floor at batch 64-256, with CUDA graphs.
TARGET_RATIO = 1.6
TARGET_BATCHES = range(64, 257)
_COPY_WINDOWS = 10
_COPIES_PER_WINDOW = 5


@dataclass
class DecodeStep:
    seconds: float
    context_tokens: int  # keys attended over, summed across the batch


@dataclass
class BatchResult:
    batch: int
    mean_context: float  # per sequence, over the timed steps
    step_ms: float  # median
    floor_ms: float
    weight_bytes: int
    kv_bytes: float  # at the mean context
    ratio: float  # step / floor
    roofline_pct: float  # 100 / ratio
    bound: str  # "memory" or "compute"


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: Any, mib: int) -> float:
    """Bytes per second of a device tensor copy, counting what it reads and
    what it writes (2 x size per copy); median over timed windows."""
    import torch

    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)  # touched, so no first-touch faults
    dst = torch.empty_like(src)
    dst.copy_(src)
    windows = []
    for _ in range(_COPY_WINDOWS):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(_COPIES_PER_WINDOW):
            dst.copy_(src)
        _sync(device)
        windows.append(time.perf_counter() - t0)
    return 2 * n * _COPIES_PER_WINDOW / median(windows)


def gemm_peak_flops(device: Any, dtype: str, divisor: int = 1) -> float:
    """FLOP/s of the best of a few large products in `dtype` (the GEMM peak
    a decode step's arithmetic can reach here); `divisor` shrinks every
    dimension (a smoke run's probe, not a peak)."""
    import torch

    best = 0.0
    for m, n, k in ((1024, 1024, 1024), (512, 4096, 1024), (2048, 2048, 768)):
        m, n, k = m // divisor, n // divisor, k // divisor
        a = torch.randn(m, k, device=device).to(getattr(torch, dtype))
        b = torch.randn(k, n, device=device).to(getattr(torch, dtype))
        for _ in range(2):
            a @ b
        windows = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(5):
                a @ b
            _sync(device)
            windows.append((time.perf_counter() - t0) / 5)
        best = max(best, 2 * m * n * k / median(windows))
    return best


def weight_bytes_per_step(model_dir: str, dtype: str) -> int:
    """Parameter bytes a decode step reads (see the module docstring): every
    checkpoint tensor but the input embedding (a step gathers one row of it
    per sequence), which it reads whole only as the tied output embedding.
    Counted from the safetensors headers: nothing is loaded and no
    transformers model is built (its import alone cost more than a smoke
    run's whole bench)."""
    import math

    import torch

    from rayvllm.models.loader import checkpoint_spec

    tied = bool(json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings", False))
    spec = checkpoint_spec(model_dir)
    read = [shape for name, (shape, _) in spec.items() if tied or not name.endswith("embed_tokens.weight")]
    return sum(math.prod(shape) for shape in read) * getattr(torch, dtype).itemsize


class DecodeTimer:
    """Wraps a ModelRunner's `execute_model` (instance attribute, so the
    executor's calls go through it) and records the steps that decode
    exactly `batch` sequences and schedule nothing else."""

    def __init__(self, runner: Any, device: Any) -> None:
        self.batch = 0
        self.steps: list[DecodeStep] = []
        inner: Callable[[Any], Any] = runner.execute_model

        def timed(so: Any) -> Any:
            pure = (
                self.batch > 0
                and len(so.num_scheduled_tokens) == self.batch
                and so.total_num_scheduled_tokens == self.batch
            )
            _sync(device)
            t0 = time.perf_counter()
            out = inner(so)
            _sync(device)
            if pure:
                context = sum(n + 1 for n in so.scheduled_cached_reqs.num_computed_tokens)
                self.steps.append(DecodeStep(time.perf_counter() - t0, context))
            return out

        runner.execute_model = timed

    def start(self, batch: int) -> None:
        self.batch = batch
        self.steps = []


def time_decode(
    llm: Any, sampling_params: Any, timer: DecodeTimer, batch: int, max_tokens: int, vocab: int,
    args: argparse.Namespace,
) -> list[DecodeStep]:
    """The timed pure-decode steps of `batch` fresh sequences (warmup dropped);
    `max_tokens` must outlast the prefill steps plus warmup and timed steps."""
    engine = llm.llm_engine
    rng = random.Random(f"roofline-{args.seed}-{batch}")
    params = sampling_params(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": random_ids(rng, args.context_len, vocab)}, params)
    timer.start(batch)
    wanted = args.warmup_steps + args.steps
    while len(timer.steps) < wanted:
        if not engine.has_unfinished_requests():
            raise RuntimeError(
                f"B={batch}: requests finished after {len(timer.steps)} of {wanted} pure decode steps "
                "(preempted for lack of KV cache?)"
            )
        engine.step()
    timed = timer.steps[args.warmup_steps:wanted]
    timer.start(0)
    if args.profile_out:
        profile_steps(engine, batch, args)
    engine.abort_request(ids)
    return timed


def profile_steps(engine: Any, batch: int, args: argparse.Namespace) -> None:
    """Five more decode steps under torch.profiler, then five under
    cProfile, appended to `--profile-out`: the ops by device time and by
    host time, and the Python functions by cumulative time, so a step far
    off its floor shows whether the device or the host holds it up."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
        if torch.cuda.is_available() and args.device.startswith("cuda"):
            torch.cuda.synchronize()
    table = prof.key_averages()
    with open(args.profile_out, "a") as f:
        f.write(f"## B={batch}, 5 decode steps, {'eager' if args.enforce_eager else 'graphs where the device has them'}\n\n")
        if args.device.startswith("cuda"):
            f.write(table.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60) + "\n\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60) + "\n\n")
    python = cProfile.Profile()
    python.runcall(lambda: [engine.step() for _ in range(5)])
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(45)
    with open(args.profile_out, "a") as f:
        f.write(f"## B={batch}, 5 more decode steps under cProfile\n\n{text.getvalue()}\n")


def summarise(
    batch: int, steps: list[DecodeStep], weight_bytes: int, kv_bytes_per_token: float, bandwidth: float,
    flops_per_row: float = 0.0, peak_flops: float = 0.0,
) -> BatchResult:
    """`flops_per_row` / `peak_flops`: the compute floor's terms (0: memory floor only)."""
    mean_context_tokens = sum(s.context_tokens for s in steps) / len(steps)
    kv_bytes = kv_bytes_per_token * mean_context_tokens
    step_s = median([s.seconds for s in steps])
    memory_s = (weight_bytes + kv_bytes) / bandwidth
    compute_s = flops_per_row * batch / peak_flops if peak_flops else 0.0
    floor_s = max(memory_s, compute_s)
    ratio = step_s / floor_s
    return BatchResult(
        batch=batch,
        mean_context=mean_context_tokens / batch,
        step_ms=step_s * 1e3,
        floor_ms=floor_s * 1e3,
        weight_bytes=weight_bytes,
        kv_bytes=kv_bytes,
        ratio=ratio,
        roofline_pct=100.0 / ratio,
        bound="compute" if compute_s > memory_s else "memory",
    )


def target_line(r: BatchResult, on_gpu: bool, graphs: bool) -> str:
    verdict = "met" if r.ratio <= TARGET_RATIO else "NOT met"
    caveats = []
    if not on_gpu:
        caveats.append("CPU")
    if not graphs:
        caveats.append("no CUDA graphs")
    if r.batch not in TARGET_BATCHES:
        caveats.append("B outside 64-256")
    note = f" (informational: {', '.join(caveats)})" if caveats else ""
    return (f"target B={r.batch}: step <= {TARGET_RATIO}x floor (>= ~60% of roofline), with CUDA graphs: "
            f"{r.ratio:.2f}x, {r.roofline_pct:.0f}%, {verdict}{note}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = args.dtype or default_dtype(args.device)
    batches = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    model = str(args.model or build_model(None, args.preset, args.device))
    vocab = model_vocab_size(model)
    # Room for the timed steps plus the chunked-prefill steps, in which early
    # sequences already decode; one block of slack.
    prefill_steps = -(-max(batches) * args.context_len // args.max_num_batched_tokens) + 1
    max_tokens = args.warmup_steps + args.steps + prefill_steps + 16 + (10 if args.profile_out else 0)

    bandwidth = copy_bandwidth(device, args.copy_mib)
    weight_bytes = weight_bytes_per_step(model, dtype)
    # The compute floor applies on CPUs (see the module docstring).
    peak = 0.0 if on_gpu else gemm_peak_flops(device, dtype, args.gemm_divisor)
    flops_per_row = 2.0 * weight_bytes / getattr(torch, dtype).itemsize
    extra = dict(device=args.device, dtype=dtype, enforce_eager=args.enforce_eager,
                 attention_backend=args.attention_backend)
    llm, sampling_params, _ = load_engine(
        "rayvllm",
        model,
        max_num_seqs=max(batches),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.context_len + max_tokens,
        enable_prefix_caching=False,
        extra_kwargs=extra,
    )
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.runner
        kv_bytes_per_token = runner.kv_bytes_per_block() / runner.block_size
        graphs = runner.cuda_graphs is not None
        timer = DecodeTimer(runner, device)
        results = [
            summarise(b, time_decode(llm, sampling_params, timer, b, max_tokens, vocab, args), weight_bytes,
                      kv_bytes_per_token, bandwidth, flops_per_row, peak)
            for b in batches
        ]
        backend = runner.attn_backend.name
    finally:
        shutdown_engine(llm)
    device_name = torch.cuda.get_device_name(device) if on_gpu else cpu_line()
    rows = [
        [str(r.batch), f"{r.mean_context:.0f}", f"{r.step_ms:.3f}", f"{r.floor_ms:.3f}", r.bound,
         f"{r.weight_bytes / 1e6:.1f}", f"{r.kv_bytes / 1e6:.1f}", f"{r.ratio:.2f}x", f"{r.roofline_pct:.0f}%"]
        for r in results
    ]
    print(f"model {model}\n{device_name} ({args.device}), {dtype}, attention {backend}, "
          f"CUDA graphs {'on' if graphs else 'off'}; median of {args.steps} decode steps after {args.warmup_steps}")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s ((read + written bytes) / time, "
          f"{args.copy_mib} MiB device-to-device copies{'' if on_gpu else ', memcpy: informational'})")
    if peak:
        print(f"{dtype} GEMM peak {peak / 1e9:.0f} GFLOP/s (best large torch.mm); compute floor "
              f"2 x {flops_per_row / 2e6:.1f}M parameters x B")
    print()
    print(format_table(
        ["B", "context/seq", "step ms", "floor ms", "bound", "weights MB", "KV MB", "step/floor", "% of roofline"],
        rows,
    ))
    print()
    for r in results:
        print(target_line(r, on_gpu, graphs))
    return {
        "model": model,
        "device": args.device,
        "device_name": device_name,
        "dtype": dtype,
        "attention_backend": backend,
        "cuda_graphs": graphs,
        "context_len": args.context_len,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "gemm_peak_flops": peak,
        "kv_bytes_per_token": kv_bytes_per_token,
        "results": [asdict(r) for r in results],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir (default: --preset's, built in ~/.cache/rayvllm)")
    p.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS), help="model preset when no --model")
    p.add_argument("--device", default="cuda", help="cuda[:N] or cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model and KV dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--batch-sizes", default="64,256", help="comma-separated decode batch sizes B")
    p.add_argument("--context-len", type=int, default=512, help="prompt tokens per sequence before decoding")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per B (median reported)")
    p.add_argument("--warmup-steps", type=int, default=10, help="pure decode steps per B before timing")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of the prefill steps")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: graphs on CUDA)")
    p.add_argument("--attention-backend", default="auto", help="auto, torch, triton or flash_attn")
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe's tensor")
    p.add_argument("--gemm-divisor", type=int, default=1,
                   help="on CPUs: divide the GEMM peak probe's dimensions by this (smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--profile-out", default=None, help="append a torch.profiler table of 5 more steps per B to FILE")
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.steps < 1 or args.warmup_steps < 0 or args.context_len < 1:
        raise SystemExit("need --steps >= 1, --warmup-steps >= 0 and --context-len >= 1")
    summary = run(args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
