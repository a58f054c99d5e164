"""Builds a tier's two halves from the engine config: the scheduler side
per DP rank, the worker side per rank of a group. The Ray tier is imported
only when configured, so the in-process engine never loads Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayvllm.config import EngineConfig
from rayvllm.config.kv_offload import kv_bytes_per_block
from rayvllm.core.block_pool import BlockPoolListener
from rayvllm.core.kv_tier import KVTier
from rayvllm.kv_offload.host_tier import HostKVStore, HostKVTier
from rayvllm.kv_offload.tier import KVBlockStore

if TYPE_CHECKING:
    import torch

    from rayvllm.kv_offload.block_io import KVBlockIO


def group_bytes_per_block(config: EngineConfig) -> int:
    """One block's KV over every layer and KV head (all ranks of a group)."""
    mc = config.model_config
    return kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, config.cache_config.block_size, mc.dtype)


def offloads_kv(config: EngineConfig) -> bool:
    """Whether the engine has a second KV tier: configured, and prefix
    caching on (the tier keys blocks by their hashes)."""
    return config.kv_offload_config is not None and config.cache_config.enable_prefix_caching


def create_kv_tier(config: EngineConfig, listener: BlockPoolListener | None = None) -> KVTier | None:
    """The scheduler side of one DP rank's tier; None without offloading.
    `listener` hears a rank-local tier's hashes come and go (the shared
    Ray tier has none to tell)."""
    oc = config.kv_offload_config
    if oc is None or not offloads_kv(config):
        return None
    per_block = group_bytes_per_block(config)
    if oc.backend == "native":
        return HostKVTier(oc.size_bytes, per_block, listener)
    from rayvllm.kv_offload.ray_tier import RayKVTier

    return RayKVTier.connect(oc, per_block, config.parallel_config.world_size)


def create_kv_block_io(
    config: EngineConfig, shard: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> KVBlockIO | None:
    """The worker side for group rank `shard` over its bound caches."""
    from rayvllm.kv_offload.block_io import KVBlockIO  # torch: the scheduler's side runs without it

    oc = config.kv_offload_config
    if oc is None or not offloads_kv(config) or not kv_caches:
        return None
    store: KVBlockStore
    if oc.backend == "native":
        store = HostKVStore(pin=config.device.startswith("cuda"))
    else:
        from rayvllm.kv_offload.ray_tier import RayKVStore

        store = RayKVStore(oc, shard, config.model_config.torch_dtype)
    return KVBlockIO(kv_caches, store)
