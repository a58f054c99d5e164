"""Applying a token bitmask (xgrammar's layout) to logits.

Layout: row r of an int32 bitmask [B, ceil(V / 32)] allows token t iff bit
`t % 32` of word `t // 32` is set; disallowed tokens get -inf.

xgrammar's own kernel does it (its CPU kernel here, its CUDA/Triton ones on
a GPU). Measured on the 2-core Xeon (one thread, half the bits set): 64
rows x 32k vocabulary 11 ms against 21 ms for unpacking the bits in torch
and `masked_fill_`, 32 x 152k 15 ms against 52 ms; equal at 8 x 4k.
"""

from __future__ import annotations

import torch


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """In place: logits[r, t] = -inf where bitmask row r disallows t, for
    the rows `rows` (None: every row). `bitmask` has one row per logits row."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
