"""Vocabulary-parallel embedding and LM head.

Each TP rank holds rows `[tp_rank * shard, (tp_rank + 1) * shard)` of the
vocabulary, `shard = ceil(vocab / tp_size)`; the last shard is padded with
zero rows so every rank's tensors have the same shape (collectives need it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext, tp_all_reduce, tp_gather_to_driver
from rayvllm.kernels.gemm_select import GemmPlan, PlannedGemm


def vocab_shard(vocab_size: int, ctx: ParallelContext) -> tuple[int, int, int]:
    """(first row, one past the last real row, padded shard size) of this rank."""
    shard = -(-vocab_size // ctx.tp_size)
    start = ctx.tp_rank * shard
    return start, min(start + shard, vocab_size), shard


class _VocabShard(nn.Module):
    """This rank's padded slice of a `[vocab, hidden]` matrix."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.parallel = ctx
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end, shard = vocab_shard(vocab_size, ctx)
        self.weight = nn.Parameter(torch.zeros(shard, hidden_size))

    def load_full(self, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight[: self.vocab_end - self.vocab_start].copy_(full[self.vocab_start : self.vocab_end])


class VocabParallelEmbedding(_VocabShard):
    """Ids outside this rank's rows embed to zero; the all-reduce fills them in."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_shard, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out, self.parallel)


class ParallelLMHead(_VocabShard):
    """Logits for this rank's vocabulary rows, gathered on TP rank 0 (the
    only rank that samples); other ranks get None.

    On the CPU (float32) the product runs the GEMM its plan chose for the
    row count (kernels/gemm_select.py); `weight` itself stays, as the
    embedding may share it.
    """

    gemm: PlannedGemm | None = None

    def use_gemm_plan(self, plan: GemmPlan) -> None:
        self.gemm = PlannedGemm(self.weight, plan)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.gemm(hidden) if self.gemm is not None else F.linear(hidden, self.weight)
        full = tp_gather_to_driver(logits, self.parallel)
        if full is None:
            return None
        if full.shape[-1] != self.vocab_size:
            full = full[:, : self.vocab_size]
        return full.float()
