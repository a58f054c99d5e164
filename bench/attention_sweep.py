"""The Triton paged-attention kernel alone at a decode step's shape, across
launch choices (split-KV count, keys per step), against the device's copy
bandwidth: where a decode step's attention stands, and which launch the
heuristics in kernels/attention_tiles.py should pick.

    python bench/attention_sweep.py [--batch-sizes 64,256] [--context-len 512]
        [--splits 1,2,4,8] [--block-n 32,64,128] [--device cuda] [--json-out FILE]

Shape: the qwen3-0.6b preset's attention (16 query heads, 8 KV heads, head
size 128), bfloat16 NHD caches of 16-token blocks (the GPU backends'),
one query per sequence, contexts drawn as decode_roofline.py draws them.
Bytes per call: every cached key and value of the batch read once, plus the
queries read and the output written; % is of the copy bandwidth.
On the CPU (`--device cpu`, the Triton interpreter, tiny sizes) it only
checks that every launch runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ensure_repo_on_path, format_table, median  # noqa: E402
from decode_roofline import copy_bandwidth  # noqa: E402

ensure_repo_on_path()

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 16, 8, 128, 16


def _inputs(batch: int, context_len: int, device: Any, seed: int) -> dict[str, Any]:
    import torch

    from rayvllm.kernels.kv_layout import KVCacheLayout, kv_cache_shapes

    rng = random.Random(f"sweep-{seed}-{batch}")
    # decode_roofline's prompts plus the decoded tokens by its timed steps
    seq_lens = [context_len + rng.randrange(0, 76) for _ in range(batch)]
    blocks_per_seq = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_shape, v_shape = kv_cache_shapes(KVCacheLayout.NHD, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16
    # Blocks shuffled, as a cache that has served many requests holds them.
    order = torch.randperm(num_blocks, generator=gen)
    return dict(
        query=torch.randn(batch, NUM_HEADS, HEAD_SIZE, generator=gen).to(device, dtype),
        key_cache=torch.randn(k_shape, generator=gen).to(device, dtype),
        value_cache=torch.randn(v_shape, generator=gen).to(device, dtype),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=order.view(batch, blocks_per_seq).to(device, torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        scale=HEAD_SIZE ** -0.5,
        layout=KVCacheLayout.NHD,
    )


def _bytes(inputs: dict[str, Any]) -> int:
    tokens = int(inputs["seq_lens"].sum())
    kv = 2 * tokens * NUM_KV_HEADS * HEAD_SIZE * inputs["key_cache"].element_size()
    return kv + 2 * inputs["query"].numel() * inputs["query"].element_size()


def _time_call(fn: Any, device: Any, iters: int) -> float:
    import torch

    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize(device)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rayvllm.kernels.attention_tiles import attention_tiles, num_kv_splits
    from rayvllm.kernels.triton_attention import paged_attention

    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, args.copy_mib)
    rows: list[dict[str, Any]] = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        inputs = _inputs(batch, args.context_len, device, args.seed)
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        # The unsplit launch's programs, as paged_attention counts them.
        group_padded = NUM_HEADS // NUM_KV_HEADS
        block_q = attention_tiles(HEAD_SIZE, 2, group_padded, 1).block_m // group_padded
        programs = (batch // block_q + batch) * NUM_KV_HEADS
        picked = num_kv_splits(programs, inputs["max_seq_len"], sm_count)
        moved = _bytes(inputs)
        for splits in (int(s) for s in args.splits.split(",")):
            for block_n in (int(n) for n in args.block_n.split(",")):
                out = torch.empty_like(inputs["query"])

                def call(splits: int = splits, block_n: int = block_n, out: Any = out) -> None:
                    paged_attention(**inputs, out=out, num_splits=splits, block_n=block_n)

                row: dict[str, Any] = dict(batch=batch, splits=splits, block_n=block_n, picked=splits == picked)
                try:
                    seconds = _time_call(call, device, args.iters)
                except Exception as e:  # a launch the device cannot take (shared memory): a row, not the end
                    row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
                else:
                    row.update(us=seconds * 1e6, gbps=moved / seconds / 1e9, pct=100 * moved / seconds / bandwidth)
                rows.append(row)
    return dict(device=str(device), bandwidth=bandwidth, context_len=args.context_len, rows=rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--splits", default="1,2,4,8", help="split-KV counts (powers of 2)")
    p.add_argument("--block-n", default="32,64,128", help="keys per inner step (powers of 2, >= 16)")
    p.add_argument("--iters", type=int, default=50, help="calls per timed window (5 windows, median)")
    p.add_argument("--copy-mib", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at import
    result = run(args)
    print(f"{result['device']}: copy bandwidth {result['bandwidth'] / 1e9:.1f} GB/s; context {args.context_len}+")
    print(format_table(
        ["B", "splits", "block_n", "us", "GB/s", "% of copy", "heuristic's"],
        [[str(r["batch"]), str(r["splits"]), str(r["block_n"])]
         + ([r["error"], "", ""] if "error" in r else [f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{r['pct']:.0f}%"])
         + ["<-" if r["picked"] and r["block_n"] == 64 else ""] for r in result["rows"]],
    ))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
