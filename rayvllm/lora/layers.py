"""A projection with LoRA slots: the base layer plus one batched LoRA
matmul over the stacked adapters of every slot.

Each slot holds, per slice of the (fused) projection, A padded to
`max_lora_rank` rows and B (scale folded in) placed at the slice's output
rows. A step multiplies every token by the A's of all slots at once
(`x @ A_all^T`, a [T, slots * width] shrink), zeroes the columns of slots
the token does not run (the step's one-hot mask; base tokens keep none),
and expands with one GEMM over the B's. Two GEMMs whatever the mix of
adapters, no per-adapter loop, no shape that depends on the batch's
adapters; a step without adapter tokens skips both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import tp_all_reduce
from rayvllm.layers.linear import Linear, RowParallelLinear


class LoRAStep:
    """The running step's adapters per token, shared by every LoRA layer:
    `mask[t, s, 0] = 1` when token `t` runs the adapter in slot `s`; None
    when no token of the step runs one."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """Wraps this rank's `base` (column- or row-parallel). Row-parallel:
    A holds this rank's input columns and the delta joins the partial sums
    before the all-reduce, so the ranks' shares add up to x A^T B^T."""

    def __init__(
        self, base: Linear, num_slices: int, max_loras: int, max_rank: int, step: LoRAStep,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.step = step
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.width = num_slices * max_rank
        self.lora_a = torch.zeros(max_loras * self.width, base.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(base.out_features, max_loras * self.width, dtype=dtype, device=device)

    def clear_slot(self, slot: int) -> None:
        cols = slice(slot * self.width, (slot + 1) * self.width)
        self.lora_a[cols].zero_()
        self.lora_b[:, cols].zero_()

    def set_slice(self, slot: int, index: int, a: torch.Tensor, b: torch.Tensor, row_start: int) -> None:
        """Slice `index` of `slot`: `a` [r, in], `b` [rows, r] (scaled) at
        output rows `[row_start, +rows)`; the slot was cleared first."""
        col = slot * self.width + index * self.max_rank
        rank = a.shape[0]
        self.lora_a[col : col + rank].copy_(a)
        self.lora_b[row_start : row_start + b.shape[0], col : col + rank].copy_(b)

    def _delta(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shrunk = F.linear(x, self.lora_a).view(x.shape[0], self.max_loras, self.width)
        return F.linear((shrunk * mask).view(x.shape[0], -1), self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.step.mask
        if mask is None:
            return self.base(x)
        base = self.base
        if not isinstance(base, RowParallelLinear):
            return base(x).add_(self._delta(x, mask))
        y = base._matmul(x).add_(self._delta(x, mask))
        if base.parallel.tp_size > 1:
            tp_all_reduce(y, base.parallel)
        if base.bias is not None:
            y += base.bias
        return y
