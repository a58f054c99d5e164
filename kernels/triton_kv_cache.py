"""Triton kernel writing a step's new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rayvllm.kernels.kv_layout import KVCacheLayout, cache_geometry, cache_strides


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    kc_stride_block,
    kc_stride_offset,
    kc_stride_head,
    kc_stride_dim,
    vc_stride_block,
    vc_stride_offset,
    vc_stride_head,
    vc_stride_dim,
    num_kv_heads,
    head_size,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
):
    """One program per token: its `[num_kv_heads, head_size]` key and value
    go to slot `slot_mapping[t]`, which is offset `slot % BLOCK_SIZE` of block
    `slot // BLOCK_SIZE`. A negative slot writes nothing. The cache strides
    are in (block, offset, head, dim) order, so the layout is the caller's
    business."""
    token = tl.program_id(0)
    # int64 from here on: block * block stride overflows int32 on big caches.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_SIZE_PADDED)[None, :]
    # A skipped slot has no live heads, so every lane is masked: -1 slots need
    # no host-side filtering and hence no device-to-host sync. (Folding the
    # test into the head bound, rather than `& (slot >= 0)`, also sidesteps
    # the 3.9 interpreter turning `tile & scalar` masks into int32.)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads < live_heads) & (dims < head_size)

    src_k = key_ptr + token.to(tl.int64) * stride_kt + heads * stride_kh + dims * stride_kd
    src_v = value_ptr + token.to(tl.int64) * stride_vt + heads * stride_vh + dims * stride_vd
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)

    dst_k = key_cache_ptr + block * kc_stride_block + offset * kc_stride_offset
    dst_v = value_cache_ptr + block * vc_stride_block + offset * vc_stride_offset
    dst_k = dst_k + heads * kc_stride_head + dims * kc_stride_dim
    dst_v = dst_v + heads * vc_stride_head + dims * vc_stride_dim
    tl.store(dst_k, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: KVCacheLayout = KVCacheLayout.SPLIT,
) -> None:
    """Write `key`/`value` `[T, num_kv_heads, head_size]` to the slots in
    `slot_mapping` `[T]` (int32 or int64; -1 = skip), casting to the caches'
    dtype. Same contract as `kernels.reference.reshape_and_cache`, for both
    layouts; the inputs may be strided views (e.g. slices of a fused QKV)."""
    block_size, num_kv_heads, head_size = cache_geometry(key_cache, value_cache, layout)
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_size) or value.shape != key.shape:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"[T, {num_kv_heads}, {head_size}] to match the cache"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2, got {block_size}")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *cache_strides(key_cache, layout, is_key=True),
        *cache_strides(value_cache, layout, is_key=False),
        num_kv_heads,
        head_size,
        BLOCK_SIZE=block_size,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size),
    )
