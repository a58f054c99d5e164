"""The wire of a weight update from a trainer into an engine's workers:
vLLM's `gloo` and `nccl` weight-transfer backends, a torch.distributed
process group of their own that the trainer (rank 0, the store's host) and
every engine worker (ranks `rank_offset` ...) join through a TCP store.

The group is separate from the workers' TP/PP world (a process has one
default group; this one is built on its own store), so it forms and goes
away without touching the ranks' collectives.

Invariant: every member takes part in the same broadcasts in the same
order. The trainer broadcasts an update's tensors in the order of its
`WeightUpdateInfo.names`; a worker receives into buffers shaped by that
info, so the collective stays aligned even when the info does not fit the
model (the worker checks it against the model afterwards, before it writes
any parameter: worker/weight_transfer.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.weight_update import WeightUpdateInfo, dtype_name

# `ray`: the trainer puts the weights in the object store once and every
# worker fetches them itself (no process group).
WEIGHT_TRANSFER_BACKENDS = ("ray", "gloo", "nccl")
# Seconds for the group to form (every member must join) and for a broadcast.
DEFAULT_TRANSFER_TIMEOUT_S = 300.0


def check_transfer_backend(backend: str) -> None:
    """A known backend that this machine can run: `nccl` only where CUDA is."""
    if backend not in WEIGHT_TRANSFER_BACKENDS:
        raise InvalidParameterError("backend", f"must be one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InvalidParameterError("backend", "nccl needs CUDA, which this process does not have; use gloo or ray")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidParameterError("dtype_names", f"{name!r} is not a torch dtype")
    return dtype


# Dtypes numpy lacks, carried as integers of the same width.
_BIT_VIEWS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


@dataclass(frozen=True)
class HostWeights:
    """A state dict as the `ray` backend puts it in the object store:
    numpy arrays, which Ray's serializer writes out of band (one copy on
    `ray.put`) and a fetch maps without copying, where a dict of torch
    tensors is pickled tensor by tensor on put and copied again on get
    (docs/BENCHMARKS.md). `bit_views`: names whose dtype numpy lacks
    (bfloat16, float8), held as integers of the same width.

    A trainer that puts its own weights puts `HostWeights.of(state_dict)`;
    `sync_weights` given a dict does so itself."""

    arrays: dict[str, np.ndarray]
    bit_views: dict[str, str]

    @staticmethod
    def of(weights: Mapping[str, torch.Tensor]) -> "HostWeights":
        arrays: dict[str, np.ndarray] = {}
        bit_views: dict[str, str] = {}
        for name, tensor in weights.items():
            tensor = tensor.detach().cpu().contiguous()
            if tensor.dtype in _BIT_VIEWS:
                bit_views[name] = dtype_name(tensor.dtype)
                tensor = tensor.view(_BIT_VIEWS[tensor.dtype])
            arrays[name] = tensor.numpy()
        return HostWeights(arrays, bit_views)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights as tensors over the arrays' memory (no copy). A fetched
        object's arrays are read-only: the loader only reads them."""
        out: dict[str, torch.Tensor] = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, array in self.arrays.items():
                tensor = torch.from_numpy(array)
                view = self.bit_views.get(name)
                out[name] = tensor if view is None else tensor.view(dtype_of(view))
        return out


class TransferGroup:
    """One member's end of the group: `rank` 0 hosts the store (the
    trainer). The constructor returns once all `world_size` members joined
    (or raises after `timeout_s`)."""

    def __init__(
        self, backend: str, master_address: str, master_port: int, rank: int, world_size: int,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        check_transfer_backend(backend)
        if backend == "ray":
            raise InvalidParameterError("backend", "ray moves weights as object refs, not over a process group")
        if not 0 <= rank < world_size:
            raise InvalidParameterError("rank_offset", f"rank {rank} is outside a group of {world_size}")
        timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.rank = rank
        try:
            self.store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
            if backend == "nccl":
                self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(self.store, rank, world_size)
            else:
                self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
            # Every member waits here for all: the first broadcast then finds a whole group.
            self._broadcast([torch.zeros(1, device=self.device)])
        except RuntimeError as e:  # torch's DistError family: a refused or silent peer, a missing member
            cause = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
            raise InvalidParameterError(
                "init_info", f"the {backend} group at {master_address}:{master_port} (world_size {world_size}, "
                f"this member's rank {rank}) did not form within timeout_s={timeout_s:g}: {cause}; check "
                "master_address, master_port and world_size, and that the trainer joined as rank 0",
            ) from None

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            self.group.broadcast([tensor], options).wait()

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: broadcast `weights` in their order (as `WeightUpdateInfo.of` lists them)."""
        assert self.rank == 0
        self._broadcast([t.detach().to(self.device).contiguous() for t in weights.values()])

    def receive(self, info: WeightUpdateInfo) -> dict[str, torch.Tensor]:
        """Another rank: the tensors of one chunk, shaped as `info` says."""
        tensors = [
            torch.empty(shape, dtype=dtype_of(dt), device=self.device) for dt, shape in zip(info.dtype_names, info.shapes)
        ]
        self.receive_into(tensors)
        return dict(zip(info.names, tensors))

    def receive_into(self, tensors: list[torch.Tensor]) -> None:
        """Another rank: one chunk into `tensors` (contiguous, on the group's
        device, in the order rank 0 sends them)."""
        assert self.rank != 0
        self._broadcast(tensors)

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]
