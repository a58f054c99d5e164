"""Shared helpers for the bench scripts.

This module imports only the standard library at module level, so the same
file serves the parent process (project python) and the engine children,
including the vLLM child that runs in the peer virtualenv without rayvllm.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "bench"
CACHE_DIR = Path(os.environ.get("RAYVLLM_BENCH_CACHE", Path.home() / ".cache" / "rayvllm"))
DEFAULT_VLLM_PYTHON = str(REPO_ROOT / ".venv-vllm" / "bin" / "python")

# Model presets for the benchmarks: keyword arguments of RandomModelSpec.
PRESETS: dict[str, dict[str, Any]] = {
    # ~25M parameters (18.4M of them in the untied embedding and LM head).
    "llama25m": dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=288,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=6,
        head_dim=48,
        max_position_embeddings=2048,
        dtype="float32",
        seed=0,
    ),
    # ~125M parameters (issue 14's second CPU model): GQA with 4 KV heads.
    "llama125m": dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        dtype="float32",
        seed=0,
    ),
    # Small enough that per-step overhead dominates; head_dim 32 so vLLM takes it.
    "tiny": dict(
        arch="llama",
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        dtype="float32",
        seed=0,
    ),
    # Qwen3-0.6B's shape and RoPE settings (issue 5's GPU benchmark), random
    # weights: 28 layers, 16 query / 8 KV heads of 128, tied embeddings,
    # ~596M parameters (~1.2 GB in bfloat16). Build it with `device="cuda"`
    # where one exists: initialising 0.6B values on a CPU takes a while.
    "qwen3-0.6b": dict(
        arch="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        extra=dict(rms_norm_eps=1e-6),
        dtype="bfloat16",
        seed=0,
    ),
}


def cpu_line() -> str:
    """The CPU a table's figures came from: model, vector ISA, the kernel
    variant rayvllm runs, any ISA cap set for MKL/oneDNN, and the core count
    (issue 14: a figure from one CPU says nothing about another)."""
    ensure_repo_on_path()
    from rayvllm.kernels.cpu_isa import cpu_info, selected_isa

    info = cpu_info()
    caps = [f"{k}={os.environ[k]}" for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    capped = f", {', '.join(caps)}" if caps else ""
    return f"{info.model} [{info.isa_summary}]; rayvllm kernels {selected_isa(info)}{capped}; {os.cpu_count()} cores"


def ensure_repo_on_path() -> None:
    """Make `import rayvllm` work from a source checkout that is not installed."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def default_model_dir(preset: str) -> Path:
    return CACHE_DIR / f"bench-{preset}"


def build_model(out: str | Path | None, preset: str = "llama25m", device: str = "cpu") -> Path:
    """Build (or reuse) the benchmark model for `preset`; returns its directory.

    The seeded initialisation runs on `device` (a GPU fills 0.6B values in
    a second); the same seed gives different weights on a CPU and a GPU,
    which no benchmark here depends on. An existing directory is reused
    whichever device built it. On CUDA the caching allocator is emptied
    afterwards, so a parent that built the model leaves the GPU's memory to
    the engine children it starts."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    ensure_repo_on_path()
    import torch

    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    path = Path(out) if out is not None else default_model_dir(preset)
    with torch.device(device):
        built = build_random_model(path, RandomModelSpec(**PRESETS[preset]))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return built


def default_dtype(device: str) -> str:
    """The benchmarks' dtype when none is given: bfloat16 on CUDA, float32
    elsewhere (the CPU kernels are float32 ones)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def model_vocab_size(model_dir: str | Path) -> int:
    with open(Path(model_dir) / "config.json") as f:
        return int(json.load(f)["vocab_size"])


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """`n` token ids from [10, vocab_size - 10): clear of special and edge ids."""
    return [rng.randrange(10, vocab_size - 10) for _ in range(n)]


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Workload:
    """What every engine runs: warmup requests, then `repeats` timed rounds.

    Every round has the same input/output lengths but fresh random ids, so a
    prefix cache never hits across rounds (0% hit rate throughout).
    """

    warmup: list[BenchRequest]
    rounds: list[list[BenchRequest]]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)

    @staticmethod
    def load(path: str | Path) -> "Workload":
        with open(path) as f:
            raw = json.load(f)

        def reqs(items: Iterable[dict[str, Any]]) -> list[BenchRequest]:
            return [BenchRequest(list(r["prompt_token_ids"]), int(r["max_tokens"])) for r in items]

        return Workload(
            warmup=reqs(raw["warmup"]),
            rounds=[reqs(r) for r in raw["rounds"]],
            max_num_seqs=int(raw["max_num_seqs"]),
            max_num_batched_tokens=int(raw["max_num_batched_tokens"]),
            max_model_len=int(raw["max_model_len"]),
            enable_prefix_caching=bool(raw["enable_prefix_caching"]),
            extra=dict(raw.get("extra", {})),
        )


def make_requests(
    num_seqs: int, min_len: int, max_len: int, vocab_size: int, seed: int, repeats: int = 1
) -> list[list[BenchRequest]]:
    """nano-vllm's bench shape: random ids, input and output lengths uniform in [min, max].

    Lengths are drawn once from `seed`; round r's ids come from `seed + 1 + r`.
    """
    if not 1 <= min_len <= max_len:
        raise SystemExit(f"need 1 <= --min-len <= --max-len, got {min_len}, {max_len}")
    rng = random.Random(seed)
    lengths = [(rng.randint(min_len, max_len), rng.randint(min_len, max_len)) for _ in range(num_seqs)]
    rounds = []
    for r in range(repeats):
        id_rng = random.Random(seed + 1 + r)
        rounds.append([BenchRequest(random_ids(id_rng, n_in, vocab_size), n_out) for n_in, n_out in lengths])
    return rounds


def make_warmup(vocab_size: int, seed: int, num: int = 4, prompt_len: int = 16, max_tokens: int = 8) -> list[BenchRequest]:
    rng = random.Random(f"warmup-{seed}")
    return [BenchRequest(random_ids(rng, prompt_len, vocab_size), max_tokens) for _ in range(num)]


def load_engine(
    engine: str,
    model: str,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 2048,
    enable_prefix_caching: bool = True,
    vllm_eager: bool = False,
    extra_kwargs: dict[str, Any] | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """Construct `engine`'s offline LLM; returns (llm, its SamplingParams class, kwargs used).

    Both get vLLM's knob names; vllm additionally float32 and
    enforce_eager=`vllm_eager`. Device and dtype come in `extra_kwargs`.
    """
    kwargs: dict[str, Any] = dict(
        model=model,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    if engine == "rayvllm":
        ensure_repo_on_path()
        from rayvllm import LLM, SamplingParams
    elif engine == "vllm":
        from vllm import LLM, SamplingParams  # type: ignore[no-redef]

        kwargs.update(dtype="float32", enforce_eager=vllm_eager, seed=0)
    else:
        raise ValueError(f"no offline LLM for engine {engine!r}")
    kwargs.update(extra_kwargs or {})
    return LLM(**kwargs), SamplingParams, kwargs


def shutdown_engine(llm: Any) -> None:
    """Best-effort clean stop of an offline LLM and anything it started.

    The children leave with os._exit (some engines hang at interpreter exit),
    which skips atexit hooks, so stop engine processes and Ray here first.
    """
    for stop in (
        lambda: llm.shutdown(),
        lambda: llm.llm_engine.engine_core.shutdown(),  # vLLM V1
    ):
        try:
            stop()
            break
        except Exception:  # noqa: BLE001 - whichever applies
            continue
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def count_output_tokens(outputs: Sequence[Any]) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def result_line(payload: dict[str, Any]) -> str:
    return "@@BENCH_RESULT@@ " + json.dumps(payload)


def emit_result(payload: dict[str, Any], result_path: str | None) -> None:
    """Print the child's JSON result line and, if asked, write it to a file too."""
    print(result_line(payload), flush=True)
    if result_path:
        with open(result_path, "w") as f:
            json.dump(payload, f)


def run_child_and_exit(
    payload: dict[str, Any], work: Callable[[], dict[str, Any]], result_path: str | None
) -> None:
    """Child-process epilogue shared by the bench scripts: run `work()`, merge
    its dict into `payload` (or record the error), emit the result, and leave
    with `os._exit`: some engines keep non-daemon threads or worker processes
    alive at interpreter exit, and the result is already written."""
    try:
        payload.update(work())
    except BaseException as exc:  # noqa: BLE001 - any failure becomes a table entry
        import traceback

        traceback.print_exc()
        payload["error"] = f"{type(exc).__name__}: {exc}"
    emit_result(payload, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if "error" not in payload else 1)


@dataclass
class ChildResult:
    payload: dict[str, Any] | None
    returncode: int
    log_tail: list[str]

    def error(self) -> str | None:
        if self.payload is not None and not self.payload.get("error"):
            return None
        if self.payload is not None:
            return str(self.payload["error"])
        tail = [ln for ln in self.log_tail if ln.strip()]
        last = tail[-1].strip() if tail else "no output"
        return f"exit code {self.returncode}: {last}"


def child_payload(child: ChildResult, engine: str, verbose: bool) -> dict[str, Any]:
    """A child's result, its error recorded (and, unless its output was
    echoed, the last lines of it shown)."""
    payload = dict(child.payload or {"engine": engine})
    err = child.error()
    if err:
        payload["error"] = err
        if not verbose:
            sys.stderr.write(f"[{engine}] failed; last output:\n" + "\n".join(child.log_tail[-15:]) + "\n")
    return payload


def run_child(
    argv: Sequence[str],
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    echo: bool = False,
    prefix: str = "",
    log_path: str | Path | None = None,
) -> ChildResult:
    """Run one engine child; stream or keep its output, return its JSON result.

    The child writes its result to a temp file named by `--result-out`; we
    also keep the last lines of its merged stdout/stderr to explain failures.
    """
    fd, result_path = tempfile.mkstemp(prefix="rayvllm-bench-", suffix=".json")
    os.close(fd)
    os.unlink(result_path)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    tail: deque[str] = deque(maxlen=60)
    log_file = open(log_path, "w") if log_path else None
    proc = subprocess.Popen(
        [*argv, "--result-out", result_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=full_env,
        text=True,
        errors="replace",
        cwd=str(REPO_ROOT),
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if log_file is not None:
                log_file.write(line)
            if echo:
                sys.stderr.write(prefix + line)
                sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = proc.wait()
        tail.append(f"killed after {timeout:.0f} s timeout")
    reader.join(timeout=5)
    if log_file is not None:
        log_file.close()
    payload: dict[str, Any] | None = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            payload = json.load(f)
        os.unlink(result_path)
    return ChildResult(payload, returncode, list(tail))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(headers, widths)),
        "  ".join("-" * w for w in widths),
    ]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
