"""Linear layers that pick the faster GEMM layout for the device.

Tensor parallelism needs no column-parallel class: a column-parallel layer
is a `Linear` over this rank's slice of output features (the model's loader
slices the weight). A row-parallel layer multiplies this rank's slice of
input features and all-reduces the partial sums (`RowParallelLinear`).

Checkpoints store weights as `[out, in]`. After loading, CPU float32 layers
are multiplied by the GEMM that measured fastest for their shape and row
count on this CPU (kernels/gemm_select.py), and keep only the weight
layouts that choice needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext, tp_all_reduce
from rayvllm.kernels.gemm_select import GemmPlan, PlannedGemm


class Linear(nn.Module):
    """`y = x W^T + b` with `W` loaded as `[out, in]`; `use_gemm_plan()`
    replaces `W` by the layouts the plan multiplies (the CPU float32 path)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.gemm: PlannedGemm | None = None

    def use_gemm_plan(self, plan: GemmPlan) -> None:
        self.gemm = PlannedGemm(self.weight, plan)
        # Drop the parameter; the plan's layouts are what is used now (a
        # `linear` layout still holds the original storage).
        self.weight = None  # type: ignore[assignment]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T` without the bias."""
        if self.gemm is not None:
            return self.gemm(x)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is None:
            return F.linear(x, self.weight, self.bias)
        y = self.gemm(x)
        return y if self.bias is None else y.add_(self.bias)


class RowParallelLinear(Linear):
    """`in_features` is this rank's slice of the input features. Invariant:
    the bias is added once, after the all-reduce, so TP ranks do not each add it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return super().forward(x)
        y = self._matmul(x)
        tp_all_reduce(y, self.parallel)
        if self.bias is not None:
            y += self.bias
        return y
