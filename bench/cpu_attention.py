"""The C prefill attention kernel alone against the path it replaces
(torch's SDPA over the chunk, the cached prefix gathered first), for each
ISA build this CPU can run: the figures behind `supports_prefill`'s gate.

    python bench/cpu_attention.py [--shapes 6x6x48,12x4x64] [--prompt-len 1024]
        [--prefix-len 0] [--repeats 5] [--json-out FILE]

A shape is `heads x kv_heads x head_size` (the presets: llama25m 6x6x48,
llama125m 12x4x64); the cache holds 16-token blocks in the CPU layout, the
blocks of one sequence shuffled as a busy pool leaves them. Each figure is
the median of `--repeats` calls after one untimed call, with torch's
threads as the engine sets them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_line, ensure_repo_on_path, format_table, median  # noqa: E402

ensure_repo_on_path()

BLOCK_SIZE = 16


def _case(heads: int, kv_heads: int, head_size: int, prompt_len: int, prefix_len: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    ctx = prefix_len + prompt_len
    num_blocks = -(-ctx // BLOCK_SIZE)
    pool = 2 * num_blocks + 1
    key_cache = torch.randn(pool, kv_heads, head_size, BLOCK_SIZE)
    value_cache = torch.randn(pool, BLOCK_SIZE, kv_heads, head_size)
    block_ids = torch.randperm(pool)[:num_blocks]
    return {
        "query": torch.randn(prompt_len, heads, head_size),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_ids": block_ids,
        "block_tables": block_ids.view(1, -1).clone(),
        "seq_rows": torch.zeros(prompt_len, dtype=torch.int64),
        "ctx_lens": torch.arange(prefix_len + 1, ctx + 1, dtype=torch.int64),
        "prefix_len": prefix_len,
        "scale": head_size**-0.5,
    }


def _sdpa(c: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    from rayvllm.kernels.reference import gather_context

    prompt_len, prefix_len = c["query"].shape[0], c["prefix_len"]
    k, v = gather_context(c["key_cache"], c["value_cache"], c["block_ids"], prefix_len + prompt_len)
    q = c["query"].transpose(0, 1).unsqueeze(0)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if prefix_len:
        import torch

        pos = torch.arange(prefix_len + prompt_len)
        mask = pos[None, :] <= (prefix_len + torch.arange(prompt_len))[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c["scale"], enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c["scale"], enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _kernel(isa: str) -> Callable[[dict[str, Any]], Any]:
    from rayvllm.kernels import cpu_attention

    def call(c: dict[str, Any]) -> Any:
        return cpu_attention.paged_attention(
            c["query"], c["key_cache"], c["value_cache"], c["block_tables"], c["seq_rows"],
            c["ctx_lens"], c["scale"], isa=isa, prefill=True,
        )

    return call


def _time(fn: Callable[[dict[str, Any]], Any], case: dict[str, Any], repeats: int) -> list[float]:
    fn(case)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(case)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="6x6x48,12x4x64")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--prefix-len", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out")
    args = parser.parse_args()

    import torch

    from rayvllm.kernels import cpu_attention
    from rayvllm.kernels.cpu_isa import selected_isa

    paths: dict[str, Callable[[dict[str, Any]], Any]] = {"sdpa": _sdpa}
    for isa in ("avx512", "avx2", "portable"):
        if cpu_attention.available(isa):
            paths[f"c-{isa}"] = _kernel(isa)
    print(cpu_line())
    print(f"torch threads {torch.get_num_threads()}; the engine's ISA: {selected_isa()}")
    rows, results = [], []
    for shape in args.shapes.split(","):
        heads, kv_heads, head_size = (int(x) for x in shape.split("x"))
        case = _case(heads, kv_heads, head_size, args.prompt_len, args.prefix_len)
        want = _sdpa(case)
        for name, fn in paths.items():
            err = float((fn(case) - want).abs().max())
            times = _time(fn, case, args.repeats)
            ms = [t * 1e3 for t in times]
            results.append({"shape": shape, "path": name, "ms": ms, "max_abs_err": err})
            rows.append([shape, name, f"{median(ms):.2f}", f"{min(ms):.2f}-{max(ms):.2f}", f"{err:.1e}"])
    print(f"prompt {args.prompt_len} tokens over a {args.prefix_len}-token cached prefix")
    print(format_table(["shape", "path", "ms (median)", "range", "max |err| vs sdpa"], rows))
    if args.json_out:
        payload = {"cpu": cpu_line(), "args": vars(args), "results": results}
        Path(args.json_out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
