"""CUDA graphs for decode steps.

A decode step launches hundreds of small kernels whose launch cost, not
their math, sets the step time at small batches. The runner captures one
forward per capture size at startup (after the KV cache is allocated,
largest first, all sharing one memory pool) and replays the smallest graph
that fits a pure-decode batch, padding the batch up to it. Larger decode
batches, and every step with a prefill, run eagerly.

A graph replays fixed kernels on fixed addresses, so its inputs live in
static device buffers that each step overwrites, and the forward it
captured must read every per-step value from them (no `.item()`, no host
branching on data: see `AttentionBackend.supports_cuda_graphs`). Padding
rows must be harmless: they write no KV (slot -1), and attend to position
0 of the null block 0, which the block pool never hands out (seq_len 1).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rayvllm.kernels.metadata import AttentionMetadata, VarlenMetadata

_SMALL_SIZES = (1, 2, 4, 8)
_STEP = 16
_NULL_BLOCK = 0


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Ascending batch sizes to capture: 1, 2, 4, 8, then multiples of 16,
    none above `max_num_seqs`."""
    sizes = [s for s in _SMALL_SIZES if s <= max_num_seqs]
    sizes += range(_STEP, max_num_seqs + 1, _STEP)
    return sizes


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size holding `num_seqs` rows; None above the
    largest (that batch runs eagerly). `sizes` ascending."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeInputs:
    """Host-side inputs of a captured decode forward, `max_size` rows.
    On CUDA these are numpy views of pinned tensors (so uploads are
    asynchronous); in tests, plain arrays."""

    input_ids: np.ndarray  # [S] int64
    positions: np.ndarray  # [S] int64
    slot_mapping: np.ndarray  # [S] int64
    seq_lens: np.ndarray  # [S] int32
    seq_start_loc: np.ndarray  # [S+1] int32, seq_start_loc[0] == 0
    block_table: np.ndarray  # [S, max_blocks] int32


def fill_padded(
    buf: DecodeInputs,
    size: int,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
) -> None:
    """Rows `[0, n)` of `buf` get the step's n decodes, rows `[n, size)`
    padding (token 0 at position 0, slot -1, seq_len 1 in the null block);
    `seq_start_loc[:size+1]` is their running total. `block_table` rows may
    be narrower than `buf`'s: columns past a row's last block are never read."""
    n = len(input_ids)
    assert n <= size <= len(buf.input_ids)
    buf.input_ids[:n] = input_ids
    buf.input_ids[n:size] = 0
    buf.positions[:n] = positions
    buf.positions[n:size] = 0
    buf.slot_mapping[:n] = slot_mapping
    buf.slot_mapping[n:size] = -1
    buf.seq_lens[:n] = seq_lens
    buf.seq_lens[n:size] = 1
    np.cumsum(buf.seq_lens[:size], out=buf.seq_start_loc[1 : size + 1])
    buf.block_table[:n, : block_table.shape[1]] = block_table
    buf.block_table[n:size] = _NULL_BLOCK


class CudaGraphRunner:
    """Captured decode forwards of one model. `forward(input_ids, positions,
    metadata)` is the model's (last-stage hidden states out).

    Invariant: a step's host buffers are rewritten only after the previous
    step's uploads finished, which holds because the model runner waits for
    each step's sampled ids before it returns."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.forward = forward
        self.sizes = list(sizes)
        self.device = device
        self.max_model_len = max_model_len
        s = self.sizes[-1]
        pin = device.type == "cuda"
        specs = {
            "input_ids": ((s,), torch.int64),
            "positions": ((s,), torch.int64),
            "slot_mapping": ((s,), torch.int64),
            "seq_lens": ((s,), torch.int32),
            "seq_start_loc": ((s + 1,), torch.int32),
            "block_table": ((s, max_blocks_per_seq), torch.int32),
        }
        self._host = {
            name: torch.zeros(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in specs.items()
        }
        self.inputs = DecodeInputs(**{name: t.numpy() for name, t in self._host.items()})
        self._static = {name: torch.zeros_like(t, device=device) for name, t in self._host.items()}
        # Every row of a decode batch is one query: the offsets never change.
        self._query_start_loc = torch.arange(s + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every size, largest first, so the smaller graphs reuse the
        pool the largest one sized."""
        pool = torch.cuda.graph_pool_handle()
        empty = np.zeros(0, dtype=np.int64)
        for size in reversed(self.sizes):
            fill_padded(self.inputs, size, empty, empty, empty, empty, np.zeros((0, 0), dtype=np.int32))
            self._upload(size)
            self._graphs[size] = self._capture(size, pool)

    def _capture(self, size: int, pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        # One eager run first: Triton compiles and cuBLAS picks its kernels
        # outside the capture, where neither may happen.
        self._run_static(size)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._run_static(size)
        return graph.replay, out

    def _run_static(self, size: int) -> torch.Tensor:
        static = self._static
        metadata = AttentionMetadata(
            slot_mapping=static["slot_mapping"][:size],
            num_decode_tokens=size,
            prefills=[],
            varlen=VarlenMetadata(
                query_start_loc=self._query_start_loc[: size + 1],
                seq_lens=static["seq_lens"][:size],
                seq_start_loc=static["seq_start_loc"][: size + 1],
                block_table=static["block_table"][:size],
                max_query_len=1,
                # A bound for any step the graph will replay.
                max_seq_len=self.max_model_len,
            ),
        )
        return self.forward(static["input_ids"][:size], static["positions"][:size], metadata)

    def _upload(self, size: int) -> None:
        for name, src in self._host.items():
            rows = size + 1 if name == "seq_start_loc" else size
            self._static[name][:rows].copy_(src[:rows], non_blocking=True)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_table: np.ndarray,
    ) -> torch.Tensor:
        """Hidden states `[n, hidden]` of n decodes (n must `fit`) by replay
        of the smallest graph that holds them."""
        size = padded_size(len(input_ids), self.sizes)
        assert size is not None, f"{len(input_ids)} decodes exceed the largest graph"
        fill_padded(self.inputs, size, input_ids, positions, slot_mapping, seq_lens, block_table)
        self._upload(size)
        replay, out = self._graphs[size]
        replay()
        return out[: len(input_ids)]
