"""Linear layers that pick the faster GEMM layout for the device, and
load their own share of a checkpoint.

Tensor parallelism needs no column-parallel class: a column-parallel layer
is a `Linear` over this rank's slice of output features, which its
`shards` name (each stacked projection's rows: q/k/v in one layer, gate
and up in another). A row-parallel layer multiplies this rank's slice of
input features (`input_cols`) and all-reduces the partial sums
(`RowParallelLinear`). `weight_loader` slices a checkpoint tensor by them,
so no loader matches names to shard.

Checkpoints store weights as `[out, in]`. After loading, CPU float32 layers
are multiplied by the GEMM that measured fastest for their shape and row
count on this CPU (kernels/gemm_select.py), and keep only the weight
layouts that choice needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext, tp_all_reduce
from rayvllm.kernels.gemm_select import GemmPlan, PlannedGemm


@dataclass(frozen=True)
class RowSlice:
    """Rows `[src, src + count)` of a checkpoint projection land at this
    layer's rows `[dst, dst + count)`; in a checkpoint that fuses the
    layer's projections into one tensor (Phi-3's qkv_proj), that
    projection's rows start at row `fused` of it."""

    dst: int
    src: int
    count: int
    fused: int = 0


class Linear(nn.Module):
    """`y = x W^T + b` with `W` loaded as `[out, in]`; `use_gemm_plan()`
    replaces `W` by the layouts the plan multiplies (the CPU float32 path).

    `shards`: the checkpoint projections this layer's output rows come
    from, by shard id (None: one tensor whose rows are all of them);
    `input_cols`: the checkpoint's input columns `[start, end)` this rank
    keeps (None: all)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False,
        shards: Mapping[str, RowSlice] | None = None, input_cols: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.gemm: PlannedGemm | None = None
        self.shards = dict(shards or {})
        self.input_cols = input_cols

    def weight_loader(self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str | None) -> None:
        """Copy this rank's share of checkpoint tensor `loaded` (a weight
        `[out, in]` or a bias `[out]`) into `dst` (the parameter, or the
        staging copy an in-place update fills): projection `shard_id`'s
        rows, or with None every shard's rows out of one fused tensor."""
        if self.input_cols is not None and loaded.dim() == 2:
            loaded = loaded[:, self.input_cols[0] : self.input_cols[1]]
        if not self.shards:
            dst.copy_(loaded)
            return
        for shard in [self.shards[shard_id]] if shard_id is not None else self.shards.values():
            src = shard.src + (shard.fused if shard_id is None else 0)
            dst[shard.dst : shard.dst + shard.count].copy_(loaded[src : src + shard.count])

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

    def __init__(
        self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext,
        input_cols: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, input_cols=input_cols)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return super().forward(x)
        y = self._matmul(x)
        tp_all_reduce(y, self.parallel)
        if self.bias is not None:
            y += self.bias
        return y
