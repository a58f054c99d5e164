"""Attention metadata for one step, built once by the model runner and shared
by every layer (so per-layer work is only the math)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    """One sequence with more than one query token this step.

    Its queries are tokens `[q_start, q_end)` of the flat batch, at positions
    `[context_len - (q_end - q_start), context_len)`. `block_ids` are the blocks
    holding its `context_len` keys, in order; `mask` is None when there is no
    cached prefix (plain causal attention over the new tokens, read from the
    step's own k/v, and then `block_ids` is None too).
    """

    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Invariants: the first `num_decode_tokens` tokens of the flat batch are
    decodes, one query per sequence, in the order of `decode_kv_index` rows;
    prefills follow. `slot_mapping[t]` is the flat cache slot token t is
    written to (-1: do not write)."""

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    prefills: list[PrefillSeq]
    # Decode inputs of the torch reference: gathered flat slots and the mask.
    decode_kv_index: torch.Tensor | None = None  # [D, L] int64 flat slots, padded
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, L] bool, True = attend
    # Decode inputs of the in-place kernels: block-table rows and context lengths.
    block_tables: torch.Tensor | None = None  # [rows, max_blocks] int64
    decode_seq_rows: torch.Tensor | None = None  # [D] int64 rows of block_tables
    decode_ctx_lens: torch.Tensor | None = None  # [D] int64
    has_negative_slots: bool = False

    @property
    def uses_block_tables(self) -> bool:
        return self.decode_seq_rows is not None
