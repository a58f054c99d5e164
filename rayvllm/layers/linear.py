"""Linear layers that pick the faster GEMM layout for the device.

Tensor parallelism needs no column-parallel class: a column-parallel layer
is a `Linear` over this rank's slice of output features (the model's loader
slices the weight). A row-parallel layer multiplies this rank's slice of
input features and all-reduces the partial sums (`RowParallelLinear`).

Checkpoints store weights as `[out, in]`. After loading, CPU float32 layers
keep one copy of the weight in the layout their GEMM reads fastest:
packed column tiles for the C kernel (kernels/cpu_gemm.py) when it builds,
otherwise a transposed `[in, out]` copy, which MKL multiplies by a few rows
2-5x faster than the `[out, in]` original (measured for 8-32 rows; equal at
64 and above). Over a step's products (`bench/gemm.py`, weights cold in
cache) the packed kernel measured 1.3-1.7x faster than MKL's transposed path
at 2-256 rows, 10% slower at one row and 6% slower at 1024 rows
(docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext, tp_all_reduce
from rayvllm.kernels import cpu_gemm


def cpu_weight_copy(weight: torch.Tensor, use_c_kernels: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(packed, None)` for the C kernel when it is wanted and builds, else
    `(None, weight^T)` contiguous for MKL."""
    if use_c_kernels and cpu_gemm.available():
        return cpu_gemm.pack_weight(weight), None
    return None, weight.detach().t().contiguous()


class Linear(nn.Module):
    """`y = x W^T + b` with `W` loaded as `[out, in]`; `optimize_for_cpu()`
    replaces `W` by the packed or transposed copy (exactly one is kept)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.weight_t: torch.Tensor | None = None
        self.weight_packed: torch.Tensor | None = None

    def optimize_for_cpu(self, use_c_kernels: bool) -> None:
        self.weight_packed, self.weight_t = cpu_weight_copy(self.weight, use_c_kernels)
        # Release the [out, in] original; only the new copy is used now.
        self.weight = None  # type: ignore[assignment]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`x W^T` without the bias."""
        if self.weight_packed is not None:
            return cpu_gemm.gemm(x, self.weight_packed, self.out_features)
        if self.weight_t is not None:
            return torch.mm(x, self.weight_t)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self._matmul(x)
        if self.weight_packed is not None:
            return self._matmul(x).add_(self.bias)
        if self.weight_t is not None:
            return torch.addmm(self.bias, x, self.weight_t)
        return F.linear(x, self.weight, self.bias)


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
