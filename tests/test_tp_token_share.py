"""`tp_share_new_tokens` over a real two-process gloo group: TP rank 0's
per-request token counts and tokens reach rank 1 as sent, a step with no
new token sends nothing more, and a failed step (counts of -1) reaches
rank 1 as such; the calls stay paired, so a later step still lines up."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayvllm.distributed.parallel_state import ParallelContext, tp_share_new_tokens

# (counts, tokens) that rank 0 sends, one step each, in this order.
STEPS: list[tuple[list[int], list[int]]] = [
    ([1, 0, 2], [7, 8, 9]),  # a decode, a prefill chunk, two accepted tokens
    ([0, 0], []),  # nothing sampled: no second broadcast
    ([-1, -1, -1, -1], []),  # the driver's step failed
    ([1], [4095]),  # and the group still lines up afterwards
]


def _rank(rank: int, store_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    try:
        ctx = ParallelContext(tp_rank=rank, tp_size=2, tp_group=dist.group.WORLD)
        got = []
        for counts, tokens in STEPS:
            if rank == 0:
                got.append(tp_share_new_tokens(counts, tokens, len(counts), torch.device("cpu"), ctx))
            else:
                got.append(tp_share_new_tokens(None, None, len(counts), torch.device("cpu"), ctx))
        Path(f"{out_file}.{rank}").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_rank_one_receives_each_step_as_rank_zero_sent_it(tmp_path: Path) -> None:
    out = tmp_path / "got"
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    want = [[counts, tokens] for counts, tokens in STEPS]
    assert json.loads(Path(f"{out}.1").read_text()) == want
    assert json.loads(Path(f"{out}.0").read_text()) == want
