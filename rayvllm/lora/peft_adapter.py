"""PEFT adapter directories, read without peft: adapter_config.json and
adapter_model.safetensors.

`check_adapter` reads the config and the safetensors header only (no
tensor data), so the front end can refuse an adapter the engine cannot run
with a 400 before any worker touches it; `load_adapter` then reads the
tensors on the workers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from rayvllm.config.lora import FUSED_MODEL_TYPES, FUSED_TARGET_MODULES, SUPPORTED_TARGET_MODULES, LoRAConfig
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.lora_request import LoRARequest

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT's key of one LoRA matrix of a decoder projection, e.g.
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config options that change what the adapter computes beyond x A^T B^T * scale.
_UNSUPPORTED_OPTIONS = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication")


@dataclass
class PeftAdapter:
    """`weights[(layer, module)] = (A [r, in], B [out, r] * scale)` in
    float32 on the host, `module` an HF projection name (`q_proj`, ...)
    and `layer` the checkpoint's global layer index."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _field(request: LoRARequest) -> str:
    return f"lora_request ({request.lora_name!r})"


def _read_config(request: LoRARequest) -> dict:
    path = Path(request.lora_path)
    config_path = path / ADAPTER_CONFIG
    if not config_path.is_file():
        raise InvalidParameterError(_field(request), f"no {ADAPTER_CONFIG} in lora_path {request.lora_path!r}")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise InvalidParameterError(
            _field(request), f"no {ADAPTER_WEIGHTS} in lora_path {request.lora_path!r} (only safetensors adapters load)"
        )
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise InvalidParameterError(_field(request), f"{ADAPTER_CONFIG} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise InvalidParameterError(_field(request), "is not a LoRA adapter (peft_type must be LORA)")
    for option in _UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise InvalidParameterError(_field(request), f"uses {option}, which rayvllm does not support")
    if config.get("bias", "none") != "none":
        raise InvalidParameterError(_field(request), f"trains biases (bias={config['bias']!r}); only bias='none' loads")
    return config


def _expected_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of the base model an adapter may target."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    separate = {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    assert tuple(separate) == SUPPORTED_TARGET_MODULES
    if hf_config.get("model_type") not in FUSED_MODEL_TYPES:
        return separate
    fused = {"qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden), "gate_up_proj": (2 * inter, hidden)}
    assert tuple(fused) == FUSED_TARGET_MODULES
    stacked = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    return {name: shape for name, shape in {**separate, **fused}.items() if name not in stacked}


def check_adapter(request: LoRARequest, lora_config: LoRAConfig, hf_config: dict) -> int:
    """The adapter's rank, after checking (config and header only) that
    this engine can run it on this model; else InvalidParameterError
    naming the request's lora and what is wrong."""
    config = _read_config(request)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InvalidParameterError(_field(request), f"{ADAPTER_CONFIG} has no positive integer r (rank)")
    if rank > lora_config.max_lora_rank:
        raise InvalidParameterError(
            _field(request), f"has rank {rank}, more than max_lora_rank={lora_config.max_lora_rank}"
        )
    shapes = _expected_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    # Names and shapes only: numpy's framework reads the header without
    # loading torch (the front end that checks a request has no use for it).
    with safe_open(str(Path(request.lora_path) / ADAPTER_WEIGHTS), framework="numpy") as f:
        keys = list(f.keys())
        for key in keys:
            match = _KEY.match(key)
            if match is None or match.group(3) not in shapes:
                raise InvalidParameterError(
                    _field(request), f"targets {key!r}; the model's LoRA target modules are {', '.join(shapes)}",
                )
            layer, module, which = int(match.group(1)), match.group(3), match.group(4)
            if layer >= num_layers:
                raise InvalidParameterError(_field(request), f"targets layer {layer}; the model has {num_layers}")
            out_features, in_features = shapes[module]
            want = (rank, in_features) if which == "A" else (out_features, rank)
            shape = tuple(f.get_slice(key).get_shape())
            if shape != want:
                raise InvalidParameterError(
                    _field(request), f"{key} has shape {list(shape)}, expected {list(want)} for this model"
                )
    if not keys:
        raise InvalidParameterError(_field(request), f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    pairs = {k.rsplit(".lora_", 1)[0] for k in keys}
    if len(keys) != 2 * len(pairs):
        raise InvalidParameterError(_field(request), "has a lora_A without its lora_B (or the reverse)")
    return rank


def load_adapter(request: LoRARequest) -> PeftAdapter:
    """The adapter's matrices, B scaled by lora_alpha / r (PEFT's rsLoRA:
    / sqrt(r)). Call after `check_adapter`."""
    config = _read_config(request)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(Path(request.lora_path) / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None:
                raise InvalidParameterError(_field(request), f"unexpected tensor {key!r}")
            found.setdefault((int(match.group(1)), match.group(3)), {})[match.group(4)] = f.get_tensor(key).float()
    weights = {where: (ab["A"], ab["B"] * scale) for where, ab in found.items()}
    return PeftAdapter(rank=rank, weights=weights)
