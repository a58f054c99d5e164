"""The Ray object store tier: the adapter over a `KVTierDirectory` for the
scheduler side (`RayKVTier`) and the workers (`RayKVStore`).

Any DP rank or replica of the same model (same `KVOffloadConfig.fingerprint`)
finds the same directory by name, so a prefix one of them computed is a
copy away for all the others. The directory is detached: it and its blocks
stay until the cluster goes or someone kills it, like any cache.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayError

from rayvllm.actors.kv_tier_directory import KV_TIER_NAMESPACE, KVTierDirectory, directory_name
from rayvllm.core.kv_cache_utils import BlockHash
from rayvllm.errors import InvalidParameterError
from rayvllm.kv_offload.config import KVOffloadConfig

# A directory call or object read slower than this counts as a miss: the
# block is recomputed rather than the step held up.
_TIMEOUT_S = 10.0
# Hashes this rank stored lately, remembered so that it does not put the
# same block again each time the pool evicts it.
_RECENT_STORES = 1 << 16


def _directory(oc: KVOffloadConfig, num_shards: int) -> Any:
    if not ray.is_initialized():
        raise InvalidParameterError("kv_offloading_backend", "'ray' needs a running Ray (the engine's Ray runtime)")
    return KVTierDirectory.options(
        name=directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(oc.size_bytes, num_shards)


class RayKVTier:
    """The scheduler side: lookups ask the directory (one call per request,
    see KVOffloadManager); stores are the workers' to register."""

    name = "ray"

    def __init__(self, directory: Any, bytes_per_block: int) -> None:
        self.directory = directory
        self.bytes_per_block = bytes_per_block
        self._recent: OrderedDict[BlockHash, None] = OrderedDict()

    @classmethod
    def connect(cls, oc: KVOffloadConfig, bytes_per_block: int, num_shards: int) -> "RayKVTier":
        """The directory for `oc.fingerprint`, created by the first engine."""
        return cls(_directory(oc, num_shards), bytes_per_block)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        try:
            return int(ray.get(self.directory.lookup.remote(list(block_hashes)), timeout=_TIMEOUT_S))
        except (RayError, GetTimeoutError):
            return 0

    def admit(self, block_hash: BlockHash) -> bool:
        recent = self._recent
        if block_hash in recent:
            recent.move_to_end(block_hash)
            return False
        recent[block_hash] = None
        if len(recent) > _RECENT_STORES:
            recent.popitem(last=False)
        return True

    def forget(self, block_hashes: Sequence[BlockHash]) -> None:
        for block_hash in block_hashes:
            self._recent.pop(block_hash, None)
        self.directory.forget.remote(list(block_hashes))

    def take_drops(self) -> list[BlockHash]:
        return []  # the directory frees what it evicts


class RayKVStore:
    """A worker's side: its shard of each block as one object owned by the
    directory (bytes, so any dtype crosses; `dtype` reads them back)."""

    def __init__(self, oc: KVOffloadConfig, shard: int, dtype: torch.dtype) -> None:
        self.name = directory_name(oc.fingerprint)
        self.shard = shard
        self.dtype = dtype
        self._handle: Any = None

    @property
    def directory(self) -> Any:
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=KV_TIER_NAMESPACE)
        return self._handle

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> None:
        owner = self.directory
        items = []
        for block_hash, block in zip(block_hashes, blocks, strict=True):
            raw = block.contiguous().view(torch.uint8).numpy()
            items.append((block_hash, self.shard, [ray.put(raw, _owner=owner)], raw.nbytes))
        owner.register.remote(items)

    def get(self, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        try:
            found = ray.get(self.directory.get_refs.remote(list(block_hashes), self.shard), timeout=_TIMEOUT_S)
        except (RayError, GetTimeoutError):
            return [None] * len(block_hashes)
        out: list[torch.Tensor | None] = []
        for refs in found:
            out.append(self._read(refs[0]) if refs else None)
        return out

    def _read(self, ref: ray.ObjectRef) -> torch.Tensor | None:
        try:
            raw = ray.get(ref, timeout=_TIMEOUT_S)
        except (RayError, GetTimeoutError):
            return None  # lost or evicted with its owner: recomputed instead
        with warnings.catch_warnings():
            # The object store's buffer is read-only; it is only copied from.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw).view(self.dtype)

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        pass  # the directory decides what the Ray tier keeps
