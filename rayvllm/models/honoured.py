"""What the Llama-shaped implementation (models/llama.py) honours of a
config.json, and the refusal by name of every attribute it would otherwise
ignore: a model whose config asks for something the layers do not do is
refused at load, never served with wrong tokens.

Each rule reads the config as transformers' own class for the model type
does (its defaults included where they decide: Qwen2's window is off unless
`use_sliding_window`).
"""

from __future__ import annotations

from typing import Any

from rayvllm.messages.errors import InvalidParameterError

# Rope variants the rotary layer computes (layers/rotary.py).
HONOURED_ROPE_TYPES = (None, "default", "linear", "llama3")
# Model types whose window applies only with `use_sliding_window` (transformers' Qwen2/Qwen3 configs).
_WINDOW_BY_FLAG = ("qwen2", "qwen3")


def _windowed_layers(cfg: dict[str, Any]) -> list[int]:
    """The layers transformers would run with sliding-window attention."""
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    window = cfg.get("sliding_window")
    if window is None:
        return []
    if cfg.get("model_type") in _WINDOW_BY_FLAG:
        if not cfg.get("use_sliding_window", False):
            return []
        first = int(cfg.get("max_window_layers", cfg["num_hidden_layers"]))
        return list(range(first, int(cfg["num_hidden_layers"])))
    return list(range(int(cfg["num_hidden_layers"])))


def unhonoured(cfg: dict[str, Any]) -> list[str]:
    """Each attribute of `cfg` the Llama-shaped layers would not honour,
    with its value."""
    found: list[str] = []
    windowed = _windowed_layers(cfg)
    if windowed:
        found.append(
            f"sliding_window={cfg.get('sliding_window')} (sliding-window attention on {len(windowed)} of "
            f"{cfg['num_hidden_layers']} layers)"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act={cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        found.append("mlp_bias=true")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(name) is not None:
            found.append(f"{name}={cfg[name]}")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in HONOURED_ROPE_TYPES:
        found.append(f"rope type {kind!r} (honoured: default, linear, llama3)")
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        found.append(f"partial_rotary_factor={partial}")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        found.append(f"quantization_config (quant_method {method!r}; quantized checkpoints are not loaded yet)")
    return found


def check_honoured(cfg: dict[str, Any]) -> None:
    """Refuse `cfg` naming every attribute the layers would not honour."""
    found = unhonoured(cfg)
    if found:
        archs = cfg.get("architectures") or [cfg.get("model_type")]
        raise InvalidParameterError(
            "model", f"{archs[0]}'s config.json sets {'; '.join(found)}, which rayvllm does not implement for "
            "this architecture; refused rather than served with wrong tokens",
        )
