"""Torch reference paged attention: the CPU path and the oracle for faster kernels.

The KV cache of one layer is a pair of tensors: keys shaped
`[num_blocks, num_kv_heads, head_size, block_size]` (a block's positions
innermost, so a kernel scores a whole block against a query with plain vector
FMAs and no horizontal sums) and values `[num_blocks, block_size,
num_kv_heads, head_size]` (a position's values contiguous, as the weighted sum
reads them). Slot `s` is position `s % block_size` of block `s // block_size`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayvllm.kernels import cpu_attention
from rayvllm.kernels.metadata import AttentionMetadata


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    has_negative_slots: bool = False,
) -> None:
    """Write `key`/`value` `[T, kv_heads, head_size]` to their slots; slots of -1 are skipped."""
    if has_negative_slots:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    kv_heads, head_size = key.shape[1], key.shape[2]
    block_size = value_cache.shape[1]
    key_cache[slot_mapping // block_size, :, :, slot_mapping % block_size] = key
    value_cache.view(-1, kv_heads, head_size).index_copy_(0, slot_mapping, value)


def gather_keys(key_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Keys at `slots` (any shape S) as `[*S, kv_heads, head_size]`."""
    block_size = key_cache.shape[3]
    return key_cache[slots // block_size, :, :, slots % block_size]


def gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `context_len` keys and values of a sequence stored in
    `block_ids`, each `[context_len, kv_heads, head_size]`. Whole blocks are
    gathered (contiguous copies), which is far cheaper than per-slot indexing
    of the transposed key layout."""
    kv_heads, head_size = value_cache.shape[2], value_cache.shape[3]
    keys = key_cache.index_select(0, block_ids).permute(0, 3, 1, 2).reshape(-1, kv_heads, head_size)
    values = value_cache.index_select(0, block_ids).view(-1, kv_heads, head_size)
    return keys[:context_len], values[:context_len]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch; `query` is `[T, heads, head_size]`,
    `key`/`value` the step's new `[T, kv_heads, head_size]` (already written
    to the cache). Returns `[T, heads, head_size]`. Decodes go to the C
    kernel when the metadata carries block tables (float32 CPU), and so do
    prefills when it carries their rows; else a gather + SDPA in torch,
    which is the oracle. `window`: a token at position p attends only to
    positions p - window + 1 .. p (transformers' sliding window).
    `softcap` c: each scaled score s counts as c * tanh(s / c) (Gemma 2)."""
    num_tokens, num_heads, head_size = query.shape
    kv_heads = value_cache.shape[2]
    out = torch.empty_like(query)
    flat_v = value_cache.view(-1, kv_heads, head_size)

    num_decodes = metadata.num_decode_tokens
    if num_decodes:
        if metadata.uses_block_tables:
            out[:num_decodes] = cpu_attention.paged_attention(
                query[:num_decodes], key_cache, value_cache, metadata.block_tables,
                metadata.decode_seq_rows, metadata.decode_ctx_lens, scale, window=window, softcap=softcap,
            )
        else:
            mask = metadata.decode_mask
            assert mask is not None
            if window is not None:
                mask = mask & _in_window(mask.sum(dim=-1), mask.shape[-1], window).view(mask.shape)
            out[:num_decodes] = _decode(
                query[:num_decodes], key_cache, flat_v, metadata.decode_kv_index, mask, scale, softcap
            )
    if metadata.prefill_seq_rows is not None:
        assert metadata.block_tables is not None and metadata.prefill_ctx_lens is not None
        out[num_decodes:] = cpu_attention.paged_attention(
            query[num_decodes:], key_cache, value_cache, metadata.block_tables,
            metadata.prefill_seq_rows, metadata.prefill_ctx_lens, scale, prefill=True, window=window,
            softcap=softcap,
        )
    for seq in metadata.prefills:
        q = query[seq.q_start : seq.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if seq.block_ids is None:
            k = key[seq.q_start : seq.q_end]
            v = value[seq.q_start : seq.q_end]
        else:
            k, v = gather_context(key_cache, value_cache, seq.block_ids, seq.context_len)
        k = k.transpose(0, 1).unsqueeze(0)
        v = v.transpose(0, 1).unsqueeze(0)
        mask = seq.mask
        if mask is None and softcap is not None:
            mask = _causal(seq.q_end - seq.q_start, q.device)
        if window is not None:
            q_len = seq.q_end - seq.q_start
            # Query i sits at position context_len - q_len + i and sees its window's keys.
            ctx_lens = torch.arange(seq.context_len - q_len + 1, seq.context_len + 1, device=q.device)[:, None]
            windowed = _in_window(ctx_lens, seq.context_len, window)
            mask = windowed & (mask if mask is not None else _causal(q_len, q.device))
        if softcap is None:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        else:
            group = q.shape[1] // k.shape[1]
            o = _capped_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask, scale, softcap)
        out[seq.q_start : seq.q_end] = o.squeeze(0).transpose(0, 1)
    return out


def _capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped logits, in transformers' arithmetic (SDPA
    has no cap): q `[..., q, D]`, k/v `[..., L, D]`, `mask` True = attend."""
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _in_window(ctx_lens: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """`[rows, num_keys]` bool: key j lies in the window of a query whose
    context is `ctx_lens[row]` keys long (positions ctx - window .. ctx - 1)."""
    return torch.arange(num_keys, device=ctx_lens.device)[None, :] >= ctx_lens.view(-1, 1) - window


def _causal(q_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    flat_v: torch.Tensor,
    kv_index: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    num_seqs, num_heads, head_size = query.shape
    kv_heads = flat_v.shape[1]
    group = num_heads // kv_heads
    # Fold the query heads of one KV head into the query-length axis, so GQA
    # needs no repeated keys: q [B, kvh, group, D] against k [B, kvh, L, D].
    q = query.view(num_seqs, kv_heads, group, head_size)
    # Padded positions may hold anything, NaN included, and neither an additive
    # -inf mask nor a zero weight cancels NaN: zero them first.
    pad = ~mask.view(num_seqs, -1, 1, 1)
    k = gather_keys(key_cache, kv_index).masked_fill_(pad, 0.0).transpose(1, 2)  # [B, kvh, L, D]
    v = flat_v[kv_index].masked_fill_(pad, 0.0).transpose(1, 2)
    if softcap is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        o = _capped_attention(q, k, v, mask, scale, softcap)
    return o.reshape(num_seqs, num_heads, head_size)
