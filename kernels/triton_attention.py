"""Triton paged attention: one kernel for decodes and for prefills over a
cached prefix (varlen), reading every key and value through block tables.

Work split. Program (t, kv_head) owns one tile of `BLOCK_Q` consecutive
queries of one sequence times the `group = num_heads // num_kv_heads` query
heads that share `kv_head`, i.e. `BLOCK_M = BLOCK_Q * GROUP_PADDED` rows of
the score matrix. Folding the GQA group into the rows lets each K/V tile
loaded from the cache serve every head that needs it, and gives decodes
(one query) enough rows for `tl.dot`. The program walks the sequence's keys
`BLOCK_N` at a time with an online softmax in float32.

Finding a tile's sequence without a host-side table: sequence b's tiles are
numbered from `first_tile(b) = query_start_loc[b] // BLOCK_Q + b`. That is
monotone in b and leaves at least `cdiv(q_len_b, BLOCK_Q)` numbers for
sequence b, so a binary search over `query_start_loc` maps a program to its
sequence, and `T // BLOCK_Q + B` programs cover every batch of T tokens in B
sequences. The few spare programs (at most one per sequence) exit at once.
The grid depends only on T and B, never on device values: no host sync.

Split-KV (flash-decoding, `kernels/attention_tiles.py` says when). With
`NUM_SPLITS` > 1 the grid gains a third axis: program (t, kv_head, s) walks
only split s of its tile's keys, `cdiv(cdiv(kv_end, NUM_SPLITS), BLOCK_N)`
tiles of them (so the last split is the short one, and splits past a short
context are empty), and writes its rows' running max, sum and unnormalised
output to float32 scratch; `_merge_splits_kernel` then rescales the splits
to a common max and divides once. Each sequence's split length comes from
its own context on the device, so the launch still depends on host ints only
and a CUDA graph captured at one context length replays at any other.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rayvllm.kernels.attention_tiles import attention_tiles, num_kv_splits
from rayvllm.kernels.kv_layout import KVCacheLayout, cache_geometry, cache_strides

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The largest b in [0, num_seqs) with query_start_loc[b] // BLOCK_Q + b <= tile."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    split_max_ptr,
    split_sum_ptr,
    split_acc_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    kc_stride_block,
    kc_stride_offset,
    kc_stride_head,
    kc_stride_dim,
    vc_stride_block,
    vc_stride_offset,
    vc_stride_head,
    vc_stride_dim,
    stride_bt_seq,
    stride_bt_block,
    num_seqs,
    group,
    head_size,
    qk_scale,
    window,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Invariants the caller guarantees (none is checked on the device):
    - sequence b's queries are rows [query_start_loc[b], query_start_loc[b+1])
      of q, at positions seq_lens[b] - q_len_b + i, and q_len_b <= seq_lens[b];
    - every key position < seq_lens[b] is in the cache already, position p at
      offset p % BLOCK_SIZE of block block_tables[b, p // BLOCK_SIZE];
    - `qk_scale` is the softmax scale times log2(e) (scores live in base 2);
      with SOFTCAP, the plain scale: a score s is capped in natural units,
      softcap * tanh(s / softcap), then taken to base 2.
    A query at position p attends to keys p - window + 1 .. p (at most 0..p:
    `window` is a sliding window, or larger than any context). Entries of
    block_tables past a sequence's last block, and cache slots past
    seq_lens[b] or before the tile's first query's window, are never read,
    so they may hold anything (garbage ids, NaN).
    With NUM_SPLITS > 1 nothing goes to `out`: row r of token t, head h,
    split s leaves its max (base 2) and sum at `split_*[(t * H + h) *
    NUM_SPLITS + s]` and its output at that index times HEAD_SIZE_PADDED."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PADDED
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PADDED
    head_in_group = rows % GROUP_PADDED
    row_valid = (q_idx < q_len) & (head_in_group < group)
    head = kv_head * group + head_in_group
    q_pos = prefix_len + q_idx
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    dim_valid = dims < head_size

    token = (q_start + q_idx).to(tl.int64)
    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    # Padded dims load as 0 so they add nothing to q.k. Padded rows may point
    # past the batch's last token, so they must issue no load at all.
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    # The last query of this tile sees keys up to its own position only, the
    # first none before its window.
    kv_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_Q)
    kv_first = tl.maximum(prefix_len + q_tile * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS == 1:
        kv_start = kv_first
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end - kv_first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = kv_first + split * split_len
        kv_end = tl.minimum(kv_end, kv_start + split_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    k_base = k_cache_ptr + kv_head * kc_stride_head
    v_base = v_cache_ptr + kv_head * vc_stride_head
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    for start in range(kv_start, kv_end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_valid = cols < kv_end
        # Masked columns issue no load, so table entries past the sequence's
        # live blocks (garbage ids) are never dereferenced.
        block = tl.load(table + (cols // BLOCK_SIZE) * stride_bt_block, mask=col_valid, other=0).to(tl.int64)
        slot_off = block * kc_stride_block + (cols % BLOCK_SIZE) * kc_stride_offset
        k = tl.load(
            k_base + slot_off[None, :] + dims[:, None] * kc_stride_dim,
            mask=col_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            # tanh(x) = 2 sigmoid(2x) - 1 (the interpreter and every backend have sigmoid).
            s = (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * (softcap * 1.4426950408889634)
        visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] > q_pos[:, None] - window)
        s = tl.where(col_valid[None, :] & visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key yet (a padded row) keeps m = -inf; shifting
        # by 0 instead keeps its p and alpha at exactly 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        p = tl.math.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        slot_off_v = block * vc_stride_block + (cols % BLOCK_SIZE) * vc_stride_offset
        # Masked value rows must be 0, not whatever the slot holds: p = 0
        # times NaN would still poison the row.
        v = tl.load(
            v_base + slot_off_v[:, None] + dims[None, :] * vc_stride_dim,
            mask=col_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Padded rows have l = 0 and are not stored; dividing them by 1 keeps
        # every lane free of 0/0.
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        # An empty split (or one whose keys a causal row cannot see yet)
        # leaves m = -inf, l = 0, acc = 0: the merge gives it weight 0.
        part = (token * (group * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(split_max_ptr + part, m_i, mask=row_valid)
        tl.store(split_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            split_acc_ptr + part[:, None] * HEAD_SIZE_PADDED + dims[None, :], acc, mask=row_valid[:, None]
        )


@triton.jit
def _merge_splits_kernel(
    split_max_ptr,
    split_sum_ptr,
    split_acc_ptr,
    out_ptr,
    query_start_loc_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    num_seqs,
    head_size,
    NUM_SPLITS: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
):
    """Program (t, h): token t's head h from its NUM_SPLITS partials. Tokens
    past the batch's last query (padding) belong to no sequence, have no
    partials, and keep their `out` row."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(split_max_ptr + part)
    # Some split holds the query's own position, which it always sees: the max is finite.
    m_all = tl.max(m, 0)
    weight = tl.math.exp2(m - m_all)
    total = tl.sum(tl.load(split_sum_ptr + part) * weight, 0)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    acc = tl.load(split_acc_ptr + part[:, None] * HEAD_SIZE_PADDED + dims[None, :])
    o = tl.sum(acc * weight[:, None], 0) / total
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=dims < head_size,
    )


def _interpreting() -> bool:
    """Whether the kernel was decorated under TRITON_INTERPRET=1 (the state
    at decoration time is what counts, not the variable's value now)."""
    return not isinstance(_paged_attention_kernel, triton.JITFunction)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_splits(device: torch.device, num_programs: int, max_seq_len: int | None) -> int:
    """Split-KV count for a launch of `num_programs` on `device` (1 when the
    caller gave no context bound)."""
    if max_seq_len is None:
        return 1
    if device.type != "cuda":
        return num_kv_splits(num_programs, max_seq_len)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_kv_splits(num_programs, max_seq_len, _sm_count(index))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    layout: KVCacheLayout = KVCacheLayout.SPLIT,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of `query` `[T, num_heads, head_size]` over the paged
    cache; returns (or fills `out`) `[T, num_heads, head_size]` in the query's
    dtype.

    `query_start_loc` `[B+1]`: cumulative query counts (sequence b owns query
    rows `[qsl[b], qsl[b+1])`, possibly none); `seq_lens` `[B]`: each
    sequence's context length including this step's queries, whose K/V are
    already cached; `block_tables` `[B, max_blocks]` (int32 or int64, any
    strides); `max_query_len` and `max_seq_len`: host ints, upper bounds of
    the q_lens and seq_lens, that only size the launch (results do not depend
    on them, and no device value is read back; without `max_seq_len` keys
    are never split). Query rows past `qsl[B]` (padding) belong to no
    sequence: their `out` rows are left untouched. `block_m`/`block_n`
    override the tile sizes (rows = queries x padded GQA group, and keys per
    step) and `num_splits` the split-KV count (a power of 2), for tuning and
    tests. `window`: a sliding window of that many keys (a query at
    position p sees p - window + 1 .. p; None: every key up to p).
    `softcap` c: each scaled score s counts as c * tanh(s / c)."""
    block_size, num_kv_heads, head_size = cache_geometry(key_cache, value_cache, layout)
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key cache {key_cache.dtype} and value cache {value_cache.dtype} differ in dtype")
    num_tokens, num_heads, q_head_size = query.shape
    num_seqs = query_start_loc.shape[0] - 1
    if q_head_size != head_size:
        raise ValueError(f"query head_size {q_head_size} != cache head_size {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if seq_lens.shape != (num_seqs,) or block_tables.dim() != 2 or block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"expected seq_lens [{num_seqs}] and block_tables [>={num_seqs}, max_blocks], got "
            f"{tuple(seq_lens.shape)} and {tuple(block_tables.shape)}"
        )
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2, got {block_size}")
    if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
        raise ValueError(f"num_splits must be a power of 2, got {num_splits}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    head_size_padded = max(16, triton.next_power_of_2(head_size))
    tiles = attention_tiles(head_size_padded, key_cache.element_size(), group_padded, max_query_len, block_m, block_n)
    block_q = tiles.block_m // group_padded
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    if num_splits is None:
        num_splits = _launch_splits(query.device, grid[0] * grid[1], max_seq_len)
    if num_splits > 1:
        split_max = torch.empty(num_tokens * num_heads * num_splits, dtype=torch.float32, device=query.device)
        split_sum = torch.empty_like(split_max)
        split_acc = torch.empty(split_max.numel() * head_size_padded, dtype=torch.float32, device=query.device)
    else:
        split_max = split_sum = split_acc = out  # never touched
    # numpy has no bfloat16: the interpreter keeps bf16 as raw uint16 bits, and
    # its tl.dot would multiply those as integers. Casting the tiles to float32
    # first is exact (bf16 -> fp32 is lossless); on a GPU bf16 feeds the tensor
    # cores directly.
    upcast = _interpreting() and torch.bfloat16 in (query.dtype, key_cache.dtype)
    _paged_attention_kernel[(*grid, num_splits)](
        query,
        key_cache,
        value_cache,
        out,
        split_max,
        split_sum,
        split_acc,
        query_start_loc,
        seq_lens,
        block_tables,
        *query.stride(),
        *out.stride(),
        *cache_strides(key_cache, layout, is_key=True),
        *cache_strides(value_cache, layout, is_key=False),
        *block_tables.stride(),
        num_seqs,
        group,
        head_size,
        scale if softcap else scale * _LOG2E,
        # No window: one past any position a context can reach (int32 on the device).
        window if window is not None else 2**31 - 1,
        softcap or 1.0,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        GROUP_PADDED=group_padded,
        BLOCK_N=tiles.block_n,
        HEAD_SIZE_PADDED=head_size_padded,
        UPCAST=upcast,
        # fp32 inputs would silently run as tf32 on tensor cores, far from the
        # fp32 reference; half types ignore this setting.
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
        NUM_SPLITS=num_splits,
        SOFTCAP=bool(softcap),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            split_max,
            split_sum,
            split_acc,
            out,
            query_start_loc,
            *out.stride(),
            num_seqs,
            head_size,
            NUM_SPLITS=num_splits,
            HEAD_SIZE_PADDED=head_size_padded,
            num_warps=4 if head_size_padded * num_splits <= 4096 else 8,
        )
    return out
