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
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from rayvllm.config.kv_offload import KVOffloadConfig
from rayvllm.kv_offload.directory import KVTierDirectory
from rayvllm.messages.block_hash import BlockHash
from rayvllm.messages.errors import InvalidParameterError

# A directory call or object read slower than this counts as a miss: the
# block is recomputed rather than the step held up.
_TIMEOUT_S = 10.0
# Hashes this rank stored lately, remembered so that it does not put the
# same block again each time the pool evicts it.
_RECENT_STORES = 1 << 16
# Where the directories live, whichever namespace their engines run in.
KV_TIER_NAMESPACE = "rayvllm_kv_tier"


def directory_name(fingerprint: str) -> str:
    return f"rayvllm-kv-tier-{fingerprint}"


@ray.remote(num_cpus=0)
class KVTierDirectoryActor(KVTierDirectory):
    """The directory as an actor: it puts every shard itself, so it owns
    the objects (they go when it drops them, not with the worker)."""

    def __init__(self, capacity_bytes: int, num_shards: int) -> None:
        super().__init__(capacity_bytes, num_shards, ray.put)


def _directory(oc: KVOffloadConfig, num_shards: int) -> Any:
    if not ray.is_initialized():
        raise InvalidParameterError("kv_offloading_backend", "'ray' needs a running Ray (the engine's Ray runtime)")
    # "DEFAULT" scheduling: not in the creating engine's placement group
    # (whose actors capture their children), which goes with that engine.
    return KVTierDirectoryActor.options(
        name=directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy="DEFAULT",
    ).remote(oc.size_bytes, num_shards)


class RayKVTier:
    """The scheduler side: lookups ask the directory (one call per request,
    see KVOffloadManager); stores are the workers' to register. A directory
    that died (and its blocks with it) is made again at the next look-up."""

    name = "ray"

    def __init__(self, oc: KVOffloadConfig, bytes_per_block: int, num_shards: int) -> None:
        self.oc = oc
        self.num_shards = num_shards
        self.directory = _directory(oc, num_shards)
        self.bytes_per_block = bytes_per_block
        self._recent: OrderedDict[BlockHash, None] = OrderedDict()

    @classmethod
    def connect(cls, oc: KVOffloadConfig, bytes_per_block: int, num_shards: int) -> "RayKVTier":
        """The directory for `oc.fingerprint`, created by the first engine."""
        return cls(oc, bytes_per_block, num_shards)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        try:
            return int(ray.get(self.directory.lookup.remote(list(block_hashes)), timeout=_TIMEOUT_S))
        except RayActorError:
            self.directory = _directory(self.oc, self.num_shards)
            self._recent.clear()
            return 0
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
    """A worker's side: its shard of each block as one object that the
    directory puts and owns (bytes, so any dtype crosses; `dtype` reads
    them back)."""

    def __init__(self, oc: KVOffloadConfig, shard: int, dtype: torch.dtype) -> None:
        self.name = directory_name(oc.fingerprint)
        self.shard = shard
        self.dtype = dtype
        self._handle: Any = None

    def _call(self, method: str, *args: Any) -> Any:
        """A directory call's result; None when there is no live directory
        (it died, or none was made yet), which then counts as a miss."""
        try:
            if self._handle is None:
                self._handle = ray.get_actor(self.name, namespace=KV_TIER_NAMESPACE)
            return ray.get(getattr(self._handle, method).remote(*args), timeout=_TIMEOUT_S)
        except ValueError:
            return None  # no directory by that name (yet, or any more)
        except (RayError, GetTimeoutError):
            self._handle = None  # look the name up again next time
            return None

    def put(self, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor]) -> None:
        items = [
            (block_hash, self.shard, block.contiguous().view(torch.uint8).numpy())
            for block_hash, block in zip(block_hashes, blocks, strict=True)
        ]
        # Waited for, so that once a step is back its blocks are findable
        # by every rank and replica (one round trip per step that stores);
        # one that is not registered is a miss for whoever looks, no error.
        self._call("register", items)

    def get(self, block_hashes: Sequence[BlockHash]) -> list[torch.Tensor | None]:
        found = self._call("get_refs", list(block_hashes), self.shard)
        if found is None:
            return [None] * len(block_hashes)
        refs = [r[0] for r in found if r]
        try:
            values = iter(ray.get(refs, timeout=_TIMEOUT_S))
        except (RayError, GetTimeoutError):
            # Some are lost (their owner or node died, or they were freed):
            # read one by one, so that only those are recomputed.
            values = iter([self._read(ref) for ref in refs])
        return [self._tensor(next(values)) if r else None for r in found]

    @staticmethod
    def _read(ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref, timeout=_TIMEOUT_S)
        except (RayError, GetTimeoutError):
            return None

    def _tensor(self, raw: Any) -> torch.Tensor | None:
        if raw is None:
            return None
        with warnings.catch_warnings():
            # The object store's buffer is read-only; it is only copied from.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw).view(self.dtype)

    def drop(self, block_hashes: Sequence[BlockHash]) -> None:
        pass  # the directory decides what the Ray tier keeps
