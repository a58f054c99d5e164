"""Applying a token bitmask (xgrammar's layout) to logits.

Layout: row r of an int32 bitmask [B, ceil(V / 32)] allows token t iff bit
`t % 32` of word `t // 32` is set; disallowed tokens get -inf.

On the CPU, float32 logits go through our C kernel (kernels/cpu_ops.py):
a grammar allows few tokens, and the kernel fills whole words of zeros 32
floats at a time over the rows' threads, where xgrammar's CPU kernel goes
bit by bit on one thread (docs/BENCHMARKS.md: it made a JSON-schema round
~1.5x slower than the unconstrained one). Without the C kernels (no
compiler) xgrammar's kernel does it; on other devices the torch unpacking
runs (xgrammar's GPU kernels are built at run time; not measured here yet).
"""

from __future__ import annotations

import torch

from rayvllm.kernels import cpu_ops


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """In place: logits[r, t] = -inf where bitmask row r disallows t, for
    the rows `rows` (None: every row). `bitmask` (on the CPU) has one row
    per logits row."""
    if logits.device.type == "cpu":
        if logits.dtype == torch.float32 and logits.stride(1) == 1 and cpu_ops.available():
            index = torch.arange(logits.shape[0]) if rows is None else torch.tensor(rows, dtype=torch.int64)
            cpu_ops.apply_token_bitmask_(logits, bitmask.contiguous(), index)
            return
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return
    apply_token_bitmask_torch_(logits, bitmask.to(logits.device, non_blocking=True), rows)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """`apply_token_bitmask_` in plain torch, on any device."""
    if rows is not None:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        sub = logits.index_select(0, index)
        apply_token_bitmask_torch_(sub, bitmask.index_select(0, index), None)
        logits.index_copy_(0, index, sub)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = torch.bitwise_right_shift(bitmask.unsqueeze(-1), shifts).bitwise_and_(1)
    allowed = bits.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(allowed.logical_not_(), float("-inf"))
