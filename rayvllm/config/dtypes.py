"""Dtypes as names: a config carries "float32", "bfloat16" or "float16"
(torch's names), and only a process that builds tensors turns one into a
`torch.dtype` (`to_torch_dtype`). A Serve replica, a router or a batch job's
feeder builds configs without ever importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayvllm.messages.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

# The names an engine argument takes, each to torch's name for it.
DTYPE_ALIASES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
# Bytes per element of each dtype a config can name.
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict, device: str) -> str:
    """vLLM's rule: "auto" takes the checkpoint's dtype, except float32 stays
    float32 and half types fall back to float32 on CPU where they are slow.
    Returns torch's name of the dtype."""
    if not isinstance(dtype, str):  # a torch.dtype
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPE_ITEMSIZE:
            raise InvalidParameterError("dtype", f"unsupported dtype {dtype}; expected one of {', '.join(DTYPE_ITEMSIZE)}")
        return name
    if dtype == "auto":
        given = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        resolved = DTYPE_ALIASES.get(str(given).removeprefix("torch."), "float32")
        return "float32" if device == "cpu" else resolved
    if dtype not in DTYPE_ALIASES:
        raise InvalidParameterError("dtype", f"unknown dtype {dtype!r}; expected one of auto, {', '.join(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[dtype]


def to_torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)
