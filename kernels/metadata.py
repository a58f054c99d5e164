"""Attention metadata for one step, built once by the model runner and shared
by every layer (so per-layer work is only the math)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch


@dataclass
class PrefillSeq:
    """One sequence with more than one query token this step.

    Its queries are tokens `[q_start, q_end)` of the flat batch, at positions
    `[context_len - (q_end - q_start), context_len)` counted from its first
    key. `block_ids` are the blocks holding its `context_len` keys, in order;
    `mask` is None when there is no cached prefix (plain causal attention over
    the new tokens, read from the step's own k/v, and then `block_ids` is None
    too). The first key is position 0 of the sequence, or, where every layer
    has a window, the start of the block holding the first query's earliest
    visible key: the blocks before it may have been released (their table
    entries hold anything) and are never handed here.
    """

    q_start: int
    q_end: int
    context_len: int
    block_ids: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class VarlenMetadata:
    """The batch as the varlen GPU kernels (Triton, flash-attn) read it.

    Sequence b owns query rows `[query_start_loc[b], query_start_loc[b+1])`
    of the flat batch, at positions `seq_lens[b] - q_len_b + i`, and attends
    causally to its first `seq_lens[b]` keys, all of which are in the cache
    when attention runs (the step's own K/V are written first), position p
    in block `block_table[b, p // block_size]`. The tensors live on the
    kernels' device, so a forward reads no host value (which is what lets a
    CUDA graph capture it); the two ints are host-side upper bounds that only
    size launches.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    seq_start_loc: torch.Tensor  # [B+1] int32, cumulative seq_lens (flash-attn's cu_seqlens_k)
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int


@dataclass
class AttentionMetadata:
    """Invariants: the first `num_decode_tokens` tokens of the flat batch are
    decodes, one query per row of `decode_kv_index` (or `decode_seq_rows`),
    each attending to its context length; a sequence verifying drafts has
    one such row per token. Prefills follow. `slot_mapping[t]` is the flat cache slot token t is
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
    # Prefill inputs of the in-place kernel, set instead of `prefills`: per
    # token after the decodes, its block-table row and context length (its
    # position + 1); a sequence's tokens are consecutive.
    prefill_seq_rows: torch.Tensor | None = None  # [T - num_decode_tokens] int64
    prefill_ctx_lens: torch.Tensor | None = None  # [T - num_decode_tokens] int64
    has_negative_slots: bool = False
    # Set instead of the torch fields above when the backend runs varlen kernels.
    varlen: VarlenMetadata | None = None

    @property
    def uses_block_tables(self) -> bool:
        return self.decode_seq_rows is not None

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "AttentionMetadata":
        """A copy with `fn` applied to every tensor (e.g. a move to the device)."""

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        varlen = self.varlen
        if varlen is not None:
            varlen = replace(
                varlen,
                query_start_loc=fn(varlen.query_start_loc),
                seq_lens=fn(varlen.seq_lens),
                seq_start_loc=fn(varlen.seq_start_loc),
                block_table=fn(varlen.block_table),
            )
        return replace(
            self,
            slot_mapping=fn(self.slot_mapping),
            prefills=[replace(p, block_ids=opt(p.block_ids), mask=opt(p.mask)) for p in self.prefills],
            decode_kv_index=opt(self.decode_kv_index),
            decode_mask=opt(self.decode_mask),
            block_tables=opt(self.block_tables),
            decode_seq_rows=opt(self.decode_seq_rows),
            decode_ctx_lens=opt(self.decode_ctx_lens),
            prefill_seq_rows=opt(self.prefill_seq_rows),
            prefill_ctx_lens=opt(self.prefill_ctx_lens),
            varlen=varlen,
        )
