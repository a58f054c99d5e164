"""What the Llama-shaped implementation (models/llama.py) honours of a
config.json (its layers' attention windows among it: `layer_windows`), and
the refusal by name of every attribute it would otherwise ignore: a model
whose config asks for something the layers do not do is refused at load,
never served with wrong tokens.

Each rule reads the config as transformers' own class for the model type
does (its defaults included where they decide: Qwen2's window is off unless
`use_sliding_window`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rayvllm.messages.errors import InvalidParameterError

# Rope variants the rotary layer computes (layers/rotary.py).
HONOURED_ROPE_TYPES = (None, "default", "linear", "llama3")
# Model types whose window applies only with `use_sliding_window` (transformers' Qwen2/Qwen3 configs).
_WINDOW_BY_FLAG = ("qwen2", "qwen3")


# The kinds of `layer_types` entries, by whether the layer attends through a window.
_LAYER_KINDS = {"full_attention": False, "sliding_attention": True}


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's attention window, as transformers reads the config
    (None: full attention): a layer with a window of W keys attends to its
    own position and the W - 1 before it. `layer_types` where given, else
    `sliding_window` on every layer, or for Qwen2/Qwen3 only with
    `use_sliding_window`, on the layers from `max_window_layers` on."""
    num_layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        unknown = sorted({kind for kind in layer_types if kind not in _LAYER_KINDS})
        if unknown:
            raise InvalidParameterError(
                "model", f"config.json's layer_types holds {unknown}, which rayvllm does not implement"
            )
        windowed = [_LAYER_KINDS[kind] for kind in layer_types]
    elif window is None or (cfg.get("model_type") in _WINDOW_BY_FLAG and not cfg.get("use_sliding_window", False)):
        windowed = [False] * num_layers
    elif cfg.get("model_type") in _WINDOW_BY_FLAG:
        first = int(cfg.get("max_window_layers", num_layers))
        windowed = [i >= first for i in range(num_layers)]
    else:
        windowed = [True] * num_layers
    if any(windowed) and window is None:
        raise InvalidParameterError(
            "model", "config.json's layer_types names sliding_attention and sliding_window is unset"
        )
    return [int(window) if w else None for w in windowed]


def kv_window(windows: Iterable[int | None]) -> int | None:
    """How many of a sequence's latest keys any of these layers (all that
    share one block table) can still read: the largest window where every
    layer has one, else None (some layer attends to every key, so no key
    ever stops being read). A query at position p then reads nothing
    before p - kv_window + 1, in any layer."""
    found = list(windows)
    if not found or None in found:
        return None
    return max(w for w in found if w is not None)


def unhonoured(cfg: dict[str, Any]) -> list[str]:
    """Each attribute of `cfg` the Llama-shaped layers would not honour,
    with its value."""
    found: list[str] = []
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
