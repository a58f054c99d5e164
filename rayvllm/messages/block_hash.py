"""Block hashing for automatic prefix caching, plus prefix-cache counters.

A full KV block is identified by a hash chain: the hash of block *i* covers the
hash of block *i-1* (its parent), the block's token ids and optional extra keys.
Two blocks with the same hash therefore hold the same tokens at the same
positions after the same prefix, so their KV values are interchangeable.

Hashes are SHA-256 digests over a fixed, explicit byte encoding, rooted at a
constant seed. They are identical across processes and machines (unlike
Python's salted ``hash()`` of ``str``/``bytes``), which lets a router compare
prefixes computed in different actors.

Only *full* blocks are ever hashed; a partial tail block has no hash.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence, Set
from typing import Any, NewType

# A 32-byte SHA-256 digest. `bytes` is hashable and compares by value, so it
# can key the cached-block map directly.
BlockHash = NewType("BlockHash", bytes)

# Extra keys mixed into a block's hash (e.g. the request's cache salt). They
# must be picklable values with a deterministic pickle encoding (str, int,
# bytes, tuples of those).
ExtraKeys = tuple[Any, ...]

# The parent of a request's first block. A fixed constant (not a random seed)
# so that the whole chain is reproducible across processes and restarts.
ROOT_BLOCK_HASH: BlockHash = BlockHash(hashlib.sha256(b"rayvllm/prefix-cache/root/v1").digest())

# Pinned so a Python upgrade that changes the default protocol cannot change
# hashes of the extra keys.
_PICKLE_PROTOCOL = 4

# One compiled struct per block length: struct.pack with a cached Struct is the
# cheapest way to get a canonical little-endian int64 encoding of the tokens.
_TOKEN_STRUCTS: dict[int, struct.Struct] = {}


def _token_struct(n: int) -> struct.Struct:
    s = _TOKEN_STRUCTS.get(n)
    if s is None:
        s = struct.Struct(f"<{n}q")
        _TOKEN_STRUCTS[n] = s
    return s


def hash_block_tokens(
    parent_block_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> BlockHash:
    """Hash one block given its parent's hash, its tokens and extra keys.

    `parent_block_hash=None` means "first block of a sequence" and uses
    `ROOT_BLOCK_HASH`. The encoding is unambiguous: a fixed-width parent, a
    length-prefixed token array, then a presence tag before the extra keys, so
    no two distinct inputs share a byte string.
    """
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    n = len(token_ids)
    h = hashlib.sha256(parent)
    h.update(n.to_bytes(8, "little"))
    h.update(_token_struct(n).pack(*token_ids))
    if extra_keys is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(pickle.dumps(tuple(extra_keys), protocol=_PICKLE_PROTOCOL))
    return BlockHash(h.digest())


# Bytes of a block hash that routing across replicas keeps: 8 of SHA-256's
# 32 make a replica's block events and reports a quarter of the size, and
# a collision (2**-64 per pair) could at worst send one request to a
# replica without its prefix.
ROUTING_KEY_BYTES = 8


def routing_key(block_hash: BlockHash) -> bytes:
    return block_hash[:ROUTING_KEY_BYTES]


def request_extra_keys(cache_salt: str | None, lora_int_id: int | None = None) -> ExtraKeys | None:
    """Extra keys for a request's *first* block: its cache salt and its
    LoRA adapter (the same tokens under another adapter have other KV).

    Only the first block needs them: every later block chains from it, so a
    different salt or adapter changes every hash of the request.
    """
    keys: tuple[Any, ...] = ()
    if cache_salt is not None:
        keys += ("cache_salt", cache_salt)
    if lora_int_id is not None:
        keys += ("lora", lora_int_id)
    return keys or None


def hit_block_hashes(
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> list[BlockHash]:
    """Hashes of the blocks that can count as prefix-cache hits: the full
    blocks of all but the last token (which is always computed)."""
    max_blocks = num_hit_blocks(block_size, len(token_ids))
    if max_blocks == 0:
        return []
    return hash_request_tokens(block_size, token_ids[: max_blocks * block_size], extra_keys)


def num_hit_blocks(block_size: int, num_tokens: int) -> int:
    """Leading full blocks of a `num_tokens` prompt that a lookup can find
    cached (the last token is always computed)."""
    return max(num_tokens - 1, 0) // block_size


def prefix_routing_keys(block_size: int, token_ids: Sequence[int], extra_keys: ExtraKeys | None = None) -> list[bytes]:
    """Routing keys of the blocks of `token_ids` that can count as prefix-cache hits."""
    return [routing_key(h) for h in hit_block_hashes(block_size, token_ids, extra_keys)]


def full_block_routing_keys(block_size: int, token_ids: Sequence[int]) -> list[bytes]:
    """Routing keys of every full block of `token_ids`: what an engine holds
    once it has prefilled them (the block of the last token included, which
    `prefix_routing_keys` leaves out: a lookup cannot hit it, a later,
    longer prompt can)."""
    return [routing_key(h) for h in hash_request_tokens(block_size, token_ids)]


def cached_prefix_tokens(block_size: int, keys: Sequence[bytes], cached_keys: Set[bytes]) -> int:
    """Tokens of the leading blocks (`prefix_routing_keys`) found in
    `cached_keys`: what a prefix-cache lookup would find there."""
    hit = 0
    for key in keys:
        if key not in cached_keys:
            break
        hit += block_size
    return hit


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids` (a trailing partial block is skipped).

    `extra_keys` is mixed into the first block only (see `request_extra_keys`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(
            parent, token_ids[start : start + block_size], extra_keys if start == 0 else None
        )
        hashes.append(parent)
    return hashes


