"""A worker's end of a weight update (vLLM's four phases): `init` joins the
trainer's process group (gloo, nccl) or does nothing (ray); `start` opens
an update; each `update` takes one chunk (a dict or an object ref to one
under `ray`, or the next tensors broadcast over the group), checks it and
stages it; `finish` hands back the whole staged set for the model to be
rebuilt from.

Invariants: every chunk is checked (names the checkpoint has, its shapes,
the engine's dtype, no name twice) before anything is staged, and nothing
is written to the model before `finish` found every checkpoint tensor
staged; so a bad update is an error that leaves the old weights serving.
An update names every tensor of the checkpoint (a full update, in as many
chunks as the trainer likes): the model's layers hold packed layouts
derived from the weights, and are rebuilt whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rayvllm.distributed.weight_transfer import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    HostWeights,
    TransferGroup,
    check_transfer_backend,
)
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.weight_update import WeightUpdateInfo

# Checkpoint tensors the model derives rather than loads.
_DERIVED = ("rotary_emb.inv_freq",)

# name -> (shape, dtype) of every checkpoint tensor (models/loader.checkpoint_spec).
CheckpointSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class WeightReceiver:
    """`spec`: the checkpoint's tensors, each required in an update;
    `optional`: more that an update may carry (checked, then left to the
    loader: a tied model's `lm_head.weight`, which a trainer's state dict
    holds and the checkpoint does not)."""

    def __init__(self, spec: CheckpointSpec, dtype: torch.dtype, optional: CheckpointSpec | None = None) -> None:
        self.required = {name: shape for name, (shape, _) in spec.items() if not name.endswith(_DERIVED)}
        self.expected = {**{name: shape for name, (shape, _) in (optional or {}).items()}, **self.required}
        self.dtype = dtype
        self.backend: str | None = None
        self.group: TransferGroup | None = None
        self.staged: dict[str, torch.Tensor] | None = None

    def init(
        self, backend: str, rank: int, master_address: str | None = None, master_port: int | None = None,
        world_size: int | None = None, timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    ) -> None:
        """Use `backend` from now on; for gloo/nccl join the trainer's group
        as `rank` (a group joined before is left)."""
        check_transfer_backend(backend)
        self.close()
        if backend != "ray":
            if master_address is None or master_port is None or world_size is None:
                raise InvalidParameterError(
                    "init_info", f"{backend} needs master_address, master_port and world_size"
                )
            self.group = TransferGroup(backend, master_address, int(master_port), rank, int(world_size), timeout_s)
        self.backend = backend

    def start(self) -> None:
        if self.backend is None:
            raise InvalidParameterError("backend", "call init_weight_transfer_engine first")
        self.staged = {}

    def update(self, info: WeightUpdateInfo | None = None, weights: Any = None) -> None:
        """Stage one chunk: `weights` (a dict of HF name -> tensor, its
        `HostWeights`, or a Ray object ref to either) under `ray`, else the
        tensors `info` announces, received from the group."""
        staged = self.staged
        if staged is None:
            raise InvalidParameterError("update_weights", "call start_weight_update first")
        if self.backend == "ray":
            if weights is None:
                raise InvalidParameterError("weights", "the ray backend takes the weights (a dict or an object ref)")
            chunk = _as_tensors(weights)
        else:
            if info is None:
                raise InvalidParameterError("update_info", f"the {self.backend} backend takes names, dtype_names, shapes")
            assert self.group is not None
            # Received whatever it holds, so the trainer's broadcasts stay in step; checked next.
            chunk = self.group.receive(info)
            if len(set(info.names)) != len(info.names):
                self._fail("a name appears twice in one chunk")
        self._check(chunk)
        staged.update(chunk)

    def _check(self, chunk: Mapping[str, torch.Tensor]) -> None:
        assert self.staged is not None
        for name, tensor in chunk.items():
            if name not in self.expected:
                self._fail(f"unknown weight {name!r} (not in the model's checkpoint)")
            if name in self.staged:
                self._fail(f"weight {name!r} sent twice in one update")
            if tuple(tensor.shape) != self.expected[name]:
                self._fail(f"weight {name!r} has shape {list(tensor.shape)}, the model's is {list(self.expected[name])}")
            if tensor.dtype != self.dtype:
                self._fail(f"weight {name!r} is {tensor.dtype}, the engine runs {self.dtype}")

    def finish(self) -> dict[str, torch.Tensor]:
        """The complete staged update (the update is closed either way)."""
        staged, self.staged = self.staged, None
        if staged is None:
            raise InvalidParameterError("finish_weight_update", "no update was started")
        missing = sorted(set(self.required) - set(staged))
        if missing:
            raise InvalidParameterError(
                "weights", f"the update lacks {len(missing)} of the model's weights (e.g. {missing[:3]}); "
                "an update must carry every weight; the old ones keep serving"
            )
        return staged

    def _fail(self, message: str) -> None:
        """Abandon the update: nothing of it was written."""
        self.staged = None
        raise InvalidParameterError("weights", f"{message}; the update is abandoned and the old weights keep serving")

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.backend = None
        self.staged = None


def _as_tensors(weights: Any) -> Mapping[str, torch.Tensor]:
    """A `ray` chunk as tensors: a dict as it is, `HostWeights` over its
    arrays (no copy), an object ref to either fetched by this worker itself
    (Ray imported here: only the ray backend loads it)."""
    if not isinstance(weights, (Mapping, HostWeights)):
        import ray

        weights = ray.get(weights)
        if not isinstance(weights, (Mapping, HostWeights)):
            raise InvalidParameterError("weights", f"the object ref holds a {type(weights).__name__}, not a dict")
    return weights.tensors() if isinstance(weights, HostWeights) else weights
