"""`KVOffloadConfig`: the second KV tier's settings, with vLLM's names
(`kv_offloading_size` in GiB, `kv_offloading_backend`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from rayvllm.config.dtypes import DTYPE_ITEMSIZE
from rayvllm.config.fields import config_field
from rayvllm.messages.errors import InvalidParameterError

# "native": host memory of each worker (vLLM's CPU offloading); "ray": the
# Ray object store, shared by every DP rank and replica of the same model.
KV_OFFLOADING_BACKENDS = ("native", "ray")

GIB = 1 << 30


@dataclass
class KVOffloadConfig:
    """`size_bytes`: the tier's capacity, the KV of all ranks of a worker
    group together (as vLLM counts it over TP ranks). With "native" each DP
    rank has a tier this large; with "ray" the one shared tier is (the
    first engine to create its directory sets the bound).

    `fingerprint`: names the model and its KV layout (see
    `kv_layout_fingerprint`); blocks are shared only between engines whose
    fingerprints match."""

    backend: str = config_field(
        "native: each worker's host memory; ray: the Ray object store, shared by the data-parallel ranks and "
        "the replicas of the same model (implies the Ray runtime)",
        arg_name="kv_offloading_backend", arg_default="native",
    )
    size_bytes: int = config_field(
        "GiB of a second KV tier behind the KV cache, for blocks it evicts (needs enable_prefix_caching); "
        "unset: no second tier",
        arg_name="kv_offloading_size", arg_type=float | None, arg_default=None,
    )
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.backend not in KV_OFFLOADING_BACKENDS:
            raise InvalidParameterError(
                "kv_offloading_backend",
                f"must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, got {self.backend!r}",
            )
        if self.size_bytes <= 0:
            raise InvalidParameterError("kv_offloading_size", f"must be > 0 GiB, got {self.size_bytes / GIB}")

    @property
    def tier_name(self) -> str:
        """The tier's label in metrics: "host" or "ray"."""
        return "host" if self.backend == "native" else "ray"


def kv_layout_fingerprint(
    model: str, hf_config: dict, dtype: str, block_size: int, tp_size: int, pp_size: int
) -> str:
    """A short digest of everything that decides what one block's KV shard
    holds: the model (path and config.json), dtype, block size and how the
    layers and heads are split over TP and PP ranks. Block hashes cover
    only tokens, so this keeps two different models apart."""
    key = json.dumps(
        [model, hf_config, str(dtype), block_size, tp_size, pp_size], sort_keys=True, default=str
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def kv_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: str
) -> int:
    """Bytes of one block's keys and values over all layers (all ranks of a group)."""
    elem = DTYPE_ITEMSIZE[dtype]
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
