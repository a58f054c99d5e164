"""What multi-LoRA costs: offline throughput of one workload under five settings.

    python bench/lora.py [--engine rayvllm|vllm|both|vllm,rayvllm] [--preset tiny|llama25m|...]
        [--num-adapters 4] [--rank 16] [--num-seqs 64] [--json-out FILE]

Settings (each in its own engine child, same prompts and lengths):
  base/lora-off   every request on the base model, enable_lora off (the reference)
  base/lora-on    every request on the base model, enable_lora on: the cost of
                  LoRA being enabled when no request uses it (target: ~0)
  one-adapter     every request on one adapter
  mixed           requests spread round-robin over `--num-adapters` adapters and
                  the base model, max_loras = num_adapters (one step mixes all)
  evicting        the same spread with max_loras = num_adapters / 2: adapters
                  wait for slots and are reloaded from the host cache

Adapters are random PEFT-format directories (rank `--rank` on q/k/v/o and
gate/up/down) written here without peft. `--engine vllm` runs the same
against the peer vLLM CPU build (bench/setup_peers.sh), which loads the same
adapter directories, one engine after the other in the order given. Output:
tok/s per setting and engine; each setting against the same engine's
base/lora-off (what LoRA costs that engine) and, with both engines,
rayvllm against vLLM per setting (LoRA off and on are separate rows); the
CPU the figures came from.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    build_model,
    count_output_tokens,
    cpu_line,
    format_table,
    load_engine,
    make_requests,
    model_vocab_size,
    run_child,
    run_child_and_exit,
    shutdown_engine,
)

SETTINGS = ("base/lora-off", "base/lora-on", "one-adapter", "mixed", "evicting")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    """A random LoRA adapter for `model_dir` in PEFT's on-disk format."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = (cfg.get("num_key_value_heads") or heads) * head_dim
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_out, n_in) in shapes.items():
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / rank**0.5 * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False,
    }))
    return out


# --------------------------------------------------------------------------- #
# Child
# --------------------------------------------------------------------------- #


def child(args: argparse.Namespace) -> dict[str, Any]:
    spec = json.loads(Path(args.spec).read_text())
    setting, adapters = args.setting, spec["adapters"]
    extra: dict[str, Any] = {}
    if setting != "base/lora-off":
        slots = {"evicting": max(1, len(adapters) // 2), "one-adapter": 1}.get(setting, len(adapters))
        extra = dict(enable_lora=True, max_loras=slots, max_lora_rank=spec["rank"], max_cpu_loras=len(adapters))
    llm, sampling_params, kwargs = load_engine(
        args.engine, spec["model"], max_num_seqs=spec["max_num_seqs"], max_model_len=spec["max_model_len"],
        extra_kwargs=extra,
    )
    if args.engine == "vllm":
        from vllm.lora.request import LoRARequest
    else:
        from rayvllm import LoRARequest
    loras = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]

    def lora_of(i: int) -> Any:
        if setting.startswith("base/"):
            return None
        if setting == "one-adapter":
            return loras[0]
        choice = i % (len(loras) + 1)  # every (n+1)-th request on the base model
        return loras[choice] if choice < len(loras) else None

    try:
        def run(requests: list[dict[str, Any]]) -> tuple[int, float]:
            prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
            params = [sampling_params(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]) for r in requests]
            lora_requests = [lora_of(i) for i in range(len(requests))]
            extra_args = {} if setting == "base/lora-off" else {"lora_request": lora_requests}
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False, **extra_args)
            return count_output_tokens(outputs), time.perf_counter() - t0

        run(spec["warmup"])
        tokens, wall = run(spec["requests"])
    finally:
        shutdown_engine(llm)
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "engine_kwargs": kwargs}


# --------------------------------------------------------------------------- #
# Parent
# --------------------------------------------------------------------------- #


def ratio_rows(results: list[dict[str, Any]], engines: list[str]) -> list[list[str]]:
    """Per setting: each engine's tok/s over its own base/lora-off, then
    rayvllm's over vLLM's when both ran; "-" where a run failed or is missing."""
    tok_s = {(r["engine"], r["setting"]): r["tok_s"] for r in results if not r.get("error") and "tok_s" in r}

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> str:
        return f"{tok_s[a] / tok_s[b]:.2f}x" if a in tok_s and b in tok_s and tok_s[b] else "-"

    settings = list(dict.fromkeys(r["setting"] for r in results))
    return [[setting, *(ratio((e, setting), (e, "base/lora-off")) for e in engines),
             *([ratio(("rayvllm", setting), ("vllm", setting))] if len(engines) == 2 else [])]
            for setting in settings]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="rayvllm",
                        help="rayvllm, vllm, both (rayvllm first) or a comma-separated order")
    parser.add_argument("--preset", default="llama25m")
    parser.add_argument("--model", default=None, help="a model directory (default: the preset's, built once)")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of the settings")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", choices=("rayvllm", "vllm"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--setting", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.engine = args.child
        run_child_and_exit({"engine": args.child, "setting": args.setting}, lambda: child(args), args.result_out)

    model = Path(args.model) if args.model else build_model(None, args.preset)
    vocab = model_vocab_size(model)
    settings = [s for s in args.settings.split(",") if s]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    engines = ["rayvllm", "vllm"] if args.engine == "both" else [e for e in args.engine.split(",") if e]
    if not engines or set(engines) - {"rayvllm", "vllm"} or len(set(engines)) != len(engines):
        raise SystemExit(f"--engine {args.engine!r}: rayvllm, vllm, both, or an order of the two")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rayvllm-bench-lora-") as tmp:
        adapters = [str(write_adapter(model, Path(tmp) / f"adapter{i}", args.rank, seed=i))
                    for i in range(args.num_adapters)]
        rounds = make_requests(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
        warmup = make_requests(min(8, args.num_seqs), 16, 16, vocab, args.seed + 100)[0]
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps({
            "model": str(model), "adapters": adapters, "rank": args.rank, "max_num_seqs": args.max_num_seqs,
            "max_model_len": args.max_model_len,
            "warmup": [vars(r) for r in warmup], "requests": [vars(r) for r in rounds[0]],
        }))
        for engine in engines:
            python = args.vllm_python if engine == "vllm" else sys.executable
            env = None
            if engine == "vllm":
                from throughput import vllm_env

                env = vllm_env({})
            for setting in settings:
                argv = [python, str(Path(__file__).resolve()), "--child", engine, "--setting", setting,
                        "--spec", str(spec_path)]
                result = run_child(argv, env=env, timeout=1800)
                error = result.error()
                results.append(result.payload or {"engine": engine, "setting": setting})
                results[-1]["error"] = error
                print(f"{engine:8s} {setting:14s} "
                      + (f"error: {error}" if error else f"{results[-1]['tok_s']:.1f} tok/s"), flush=True)
    rows = [[r["engine"], r["setting"], "-" if r.get("error") else f"{r['tok_s']:.1f}"] for r in results]
    print(format_table(["engine", "setting", "output tok/s"], rows))
    print()
    print(format_table(["setting", *(f"{e} / its base/lora-off" for e in engines),
                        *(["rayvllm / vLLM"] if len(engines) == 2 else [])], ratio_rows(results, engines)))
    machine = cpu_line()
    print(f"machine: {machine}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": machine, "args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
