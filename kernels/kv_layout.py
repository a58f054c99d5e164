"""Physical layouts of one layer's paged KV cache.

Every kernel addresses a cache element by four logical coordinates — (block,
offset in block, KV head, dim) — and multiplies them with the strides that
`cache_strides` returns, so one kernel serves every layout here and a new
layout needs only a new member and its shapes.
"""

from __future__ import annotations

import enum

import torch


class KVCacheLayout(enum.Enum):
    """`SPLIT`: the CPU layout of `kernels/reference.py`, keys
    `[num_blocks, num_kv_heads, head_size, block_size]` and values
    `[num_blocks, block_size, num_kv_heads, head_size]`.
    `NHD`: flash-attn's paged layout, keys and values both
    `[num_blocks, block_size, num_kv_heads, head_size]`."""

    SPLIT = "split"
    NHD = "nhd"


Shape = tuple[int, ...]


def kv_cache_shapes(
    layout: KVCacheLayout, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[Shape, Shape]:
    """(key cache shape, value cache shape) of one layer in `layout`."""
    nhd = (num_blocks, block_size, num_kv_heads, head_size)
    if layout is KVCacheLayout.SPLIT:
        return (num_blocks, num_kv_heads, head_size, block_size), nhd
    if layout is KVCacheLayout.NHD:
        return nhd, nhd
    raise ValueError(f"unknown KV cache layout {layout!r}")


def cache_strides(
    cache: torch.Tensor, layout: KVCacheLayout, *, is_key: bool
) -> tuple[int, int, int, int]:
    """Strides of `cache` (a key cache when `is_key`, else a value cache) in
    (block, offset in block, KV head, dim) order. Works on views with any
    strides, so a kernel never assumes contiguity."""
    if cache.dim() != 4:
        raise ValueError(f"a KV cache is 4-D, got shape {tuple(cache.shape)}")
    s = cache.stride()
    if layout is KVCacheLayout.SPLIT and is_key:
        return s[0], s[3], s[1], s[2]
    if layout in (KVCacheLayout.SPLIT, KVCacheLayout.NHD):
        return s[0], s[1], s[2], s[3]
    raise ValueError(f"unknown KV cache layout {layout!r}")


def cache_geometry(
    key_cache: torch.Tensor, value_cache: torch.Tensor, layout: KVCacheLayout
) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_size) read from the caches, after
    checking that the key and value caches agree with each other and `layout`."""
    num_blocks, block_size, num_kv_heads, head_size = value_cache.shape
    expected, _ = kv_cache_shapes(layout, num_blocks, block_size, num_kv_heads, head_size)
    if tuple(key_cache.shape) != expected:
        raise ValueError(
            f"key cache shape {tuple(key_cache.shape)} does not match value cache "
            f"shape {tuple(value_cache.shape)} in layout {layout.name} (expected {expected})"
        )
    return block_size, num_kv_heads, head_size
