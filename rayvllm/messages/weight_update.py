"""What a weight update over a process group announces: the message the
trainer's `update_weights` call carries to every engine worker, which the
front ends (offline, async, HTTP) pass through without touching a tensor."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayvllm.messages.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch


def dtype_name(dtype: "torch.dtype") -> str:
    """`torch.float32` -> "float32" (vLLM's `dtype_names`)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class WeightUpdateInfo:
    """What one `update_weights` chunk carries over a process group (vLLM's
    `update_info`): the HF names, dtypes and shapes of the tensors the
    trainer broadcasts next, in that order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise InvalidParameterError(
                "update_info",
                f"names, dtype_names and shapes differ in length ({len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)})",
            )

    @staticmethod
    def of(weights: Mapping[str, "torch.Tensor"]) -> "WeightUpdateInfo":
        return WeightUpdateInfo(
            list(weights), [dtype_name(t.dtype) for t in weights.values()], [list(t.shape) for t in weights.values()]
        )
