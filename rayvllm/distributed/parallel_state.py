"""One rank's place in its worker group, and the collectives the model uses.

A worker group serves one data-parallel rank: `tp_size * pp_size` ranks,
global rank `pp_rank * tp_size + tp_rank`, one torch.distributed world per
group. Layers receive a `ParallelContext` instead of reading process-wide
state, so the single-process engine passes the default (no group at all) and
every collective below is then a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    """Invariants: `0 <= tp_rank < tp_size`, `0 <= pp_rank < pp_size`;
    `tp_group` is None exactly when `tp_size == 1`."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The one rank that samples: TP rank 0 of the last stage. Every
        other rank learns sampled tokens from the next SchedulerOutput, or
        under async scheduling (no pipeline stages) from this rank's
        `tp_share_new_tokens` at the end of the step."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def prev_stage_rank(self) -> int:
        return self.rank - self.tp_size


def tp_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum `x` over the TP group in place."""
    if ctx.tp_size > 1:
        dist.all_reduce(x, group=ctx.tp_group)
    return x


def tp_gather_to_driver(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor | None:
    """Concatenate each TP rank's `x` along the last dim on TP rank 0;
    the other ranks get None. Shards must have equal shapes."""
    if ctx.tp_size == 1:
        return x
    x = x.contiguous()
    if ctx.tp_rank == 0:
        parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
        dist.gather(x, parts, group=ctx.tp_group, group_dst=0)
        return torch.cat(parts, dim=-1)
    dist.gather(x, None, group=ctx.tp_group, group_dst=0)
    return None


def tp_share_new_tokens(
    counts: list[int] | None, tokens: list[int] | None, n: int, device: torch.device, ctx: ParallelContext
) -> tuple[list[int], list[int]]:
    """The tokens the driver appended this step to each of its `n` scheduled
    requests (`counts[i]` of them, flat in `tokens`), from TP rank 0 to the
    group (on `device`, the group's backend's): the driver passes its lists,
    the others None. A count of -1 for every request means the driver's
    step failed and appended nothing."""
    assert ctx.tp_size > 1
    if ctx.tp_rank == 0:
        assert counts is not None and tokens is not None and len(counts) == n
        head = torch.tensor(counts, dtype=torch.int64, device=device)
    else:
        head = torch.empty(n, dtype=torch.int64, device=device)
    dist.broadcast(head, group=ctx.tp_group, group_src=0)
    got_counts: list[int] = head.tolist()
    total = sum(c for c in got_counts if c > 0)
    if total == 0:
        return got_counts, []
    if ctx.tp_rank == 0:
        body = torch.tensor(tokens, dtype=torch.int64, device=device)
    else:
        body = torch.empty(total, dtype=torch.int64, device=device)
    dist.broadcast(body, group=ctx.tp_group, group_src=0)
    return got_counts, body.tolist()


def send_to_next_stage(hidden: torch.Tensor, residual: torch.Tensor, ctx: ParallelContext) -> None:
    """Hidden states and residual go to the same TP rank of the next stage,
    stacked into one message."""
    dist.send(torch.stack([hidden, residual]).contiguous(), dst=ctx.next_stage_rank)


def recv_from_prev_stage(
    num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device, ctx: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(buf, src=ctx.prev_stage_rank)
    return buf[0], buf[1]
