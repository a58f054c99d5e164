"""The bodies of the RL control-plane routes: pause, sleep, and weight transfer
(vLLM's names and shapes: `init_info`, `update_info`). Over HTTP only the process-group backends
apply (gloo, nccl): the route carries the group's address and each chunk's
metadata, and the tensors travel over the group; the `ray` backend's
object refs go through the Python handle (`sync_weights`, `update_weights`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WeightTransferInitInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["gloo", "nccl"] = "gloo"
    master_address: str
    master_port: int
    world_size: int
    # The first engine worker's rank in the trainer's group (the trainer is 0).
    rank_offset: int = 1
    # How long the group may take to form (and each broadcast to finish);
    # unset: the engine's default (DEFAULT_TRANSFER_TIMEOUT_S).
    timeout_s: float | None = Field(None, gt=0)


class WeightTransferInitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    init_info: WeightTransferInitInfo


class WeightUpdateInfoBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update_info: WeightUpdateInfoBody


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["abort", "wait", "keep"] = "abort"
    clear_cache: bool = False


class SleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal[1, 2] = 1


class WakeUpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # None: everything asleep ("weights", "kv_cache").
    tags: list[str] | None = None
