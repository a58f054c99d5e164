"""Linear layers that pick the faster GEMM layout for the device.

Tensor parallelism needs no column-parallel class: a column-parallel layer
is a `Linear` over this rank's slice of output features (the model's loader
slices the weight). A row-parallel layer multiplies this rank's slice of
input features and all-reduces the partial sums (`RowParallelLinear`).

Checkpoints store weights as `[out, in]`. On the CPU, MKL multiplies a few
rows by a transposed `[in, out]` copy 2-5x faster than by the `[out, in]`
original (measured for 8-32 rows; equal at 64 and above), so after loading,
CPU float32 layers keep only the transposed copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext, tp_all_reduce


class Linear(nn.Module):
    """`y = x W^T + b` with `W` loaded as `[out, in]`; `use_transposed()`
    switches to storing `W^T` contiguously and multiplying with `addmm`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None

    def use_transposed(self) -> None:
        self.weight_t = self.weight.detach().t().contiguous()
        # Release the [out, in] original; only the transposed copy is used now.
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class RowParallelLinear(Linear):
    """`in_features` is this rank's slice of the input features. Invariant:
    the bias is added once, after the all-reduce, so TP ranks do not each add it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return super().forward(x)
        y = torch.mm(x, self.weight_t) if self.weight_t is not None else F.linear(x, self.weight)
        tp_all_reduce(y, self.parallel)
        if self.bias is not None:
            y += self.bias
        return y
