"""What the Llama-shaped implementation (models/llama.py) and the families
built on it honour of a config.json (each layer's attention window:
`layer_windows`; its rotary embedding: `layer_rope`), and the refusal by
name of every attribute they would otherwise ignore: a model whose config
asks for something its family's layers do not do is refused at load, never
served with wrong tokens. What a family does beyond Llama it declares in
its `Honours`.

Each rule reads the config as transformers' own class for the model type
does (its defaults included where they decide: Qwen2's window is off unless
`use_sliding_window`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rayvllm.messages.errors import InvalidParameterError

# Rope variants the rotary layer computes (layers/rotary.py).
HONOURED_ROPE_TYPES = (None, "default", "linear", "llama3", "longrope")
# Model types whose window applies only with `use_sliding_window` (transformers' Qwen2/Qwen3 configs).
_WINDOW_BY_FLAG = ("qwen2", "qwen3")
# Model types whose config.json may give no `layer_types` (checkpoints saved
# before transformers had them): every n-th layer attends fully, the others
# through the window (`sliding_window_pattern` overrides n).
_WINDOW_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# Model types whose transformers attention takes no window (its mask is fully causal whatever the config
# says, while its cache would keep only a window's keys): a window in their config.json is refused.
_NO_WINDOW = ("olmo2",)


# The kinds of `layer_types` entries, by whether the layer attends through a window.
_LAYER_KINDS = {"full_attention": False, "sliding_attention": True}


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's attention window, as transformers reads the config
    (None: full attention): a layer with a window of W keys attends to its
    own position and the W - 1 before it. `layer_types` where given, else
    `sliding_window` on every layer, or for Qwen2/Qwen3 only with
    `use_sliding_window`, on the layers from `max_window_layers` on, or for
    Gemma 2 and 3 on all but every n-th layer."""
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
    elif cfg.get("model_type") in _WINDOW_PATTERN:
        every = int(cfg.get("sliding_window_pattern") or _WINDOW_PATTERN[cfg["model_type"]])
        windowed = [(i + 1) % every != 0 for i in range(num_layers)]
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


def layer_rope(cfg: dict[str, Any], window: int | None) -> tuple[float, dict[str, Any]]:
    """A layer's RoPE base and scaling parameters: from `rope_parameters`
    keyed by layer kind where the config has them so (Gemma 3: sliding
    layers on a local base; its older config.json gives the local base as
    `rope_local_base_freq`, unscaled), else the model's one setting."""
    if window is not None and cfg.get("rope_local_base_freq") is not None:
        return float(cfg["rope_local_base_freq"]), {}
    rope = _rope_setting(cfg)
    if _by_layer_kind(rope):
        rope = rope.get("sliding_attention" if window is not None else "full_attention") or {}
        return float(rope.get("rope_theta", 10000.0)), rope
    if rope.get("rope_type", rope.get("type")) == "longrope":
        # Its scaling reads the context lengths, which the config may keep beside it.
        lengths = ("original_max_position_embeddings", "max_position_embeddings")
        rope = {**rope, **{name: rope.get(name) or cfg.get(name) for name in lengths}}
    return float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))), rope


def _rope_setting(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's RoPE parameters, under either name transformers writes."""
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _by_layer_kind(rope: dict[str, Any]) -> bool:
    """The parameters are one setting per layer kind (Gemma 3's), not one setting."""
    return bool(set(rope) & set(_LAYER_KINDS))


def _rope_settings(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Every RoPE setting of the config (one, or one per layer kind)."""
    rope = _rope_setting(cfg)
    return [r or {} for r in rope.values()] if _by_layer_kind(rope) else [rope]


@dataclass(frozen=True)
class Honours:
    """What a family's layers implement beyond Llama's: its MLP activation
    (config.json's `hidden_activation`, else `hidden_act`), soft caps on the
    attention and final logits, and a softmax scale of
    `query_pre_attn_scalar ** -0.5` (Gemma 2 and 3)."""

    activation: str = "silu"
    softcapping: bool = False
    query_pre_attn_scalar: bool = False


def unhonoured(cfg: dict[str, Any], honours: Honours = Honours()) -> list[str]:
    """Each attribute of `cfg` that the layers of a family honouring
    `honours` would not honour, with its value."""
    found: list[str] = []
    activation_key = "hidden_activation" if cfg.get("hidden_activation") is not None else "hidden_act"
    activation = cfg.get(activation_key, honours.activation)
    if activation != honours.activation:
        found.append(f"{activation_key}={activation!r} (this architecture implements {honours.activation})")
    if cfg.get("mlp_bias"):
        found.append("mlp_bias=true")
    if cfg.get("use_bidirectional_attention"):
        found.append("use_bidirectional_attention=true (decoders attend causally here)")
    capped = ("attn_logit_softcapping", "final_logit_softcapping") if not honours.softcapping else ()
    for name in capped + (() if honours.query_pre_attn_scalar else ("query_pre_attn_scalar",)):
        if cfg.get(name) is not None:
            found.append(f"{name}={cfg[name]}")
    for rope in _rope_settings(cfg):
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in HONOURED_ROPE_TYPES:
            found.append(f"rope type {kind!r} (honoured: default, linear, llama3, longrope)")
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            found.append(f"partial_rotary_factor={partial}")
    if cfg.get("model_type") in _NO_WINDOW and any(w is not None for w in layer_windows(cfg)):
        found.append(f"sliding_window={cfg.get('sliding_window')} ({cfg['model_type']} attends over the full context)")
    quantization = cfg.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        found.append(f"quantization_config (quant_method {method!r}; quantized checkpoints are not loaded yet)")
    return list(dict.fromkeys(found))


def check_honoured(cfg: dict[str, Any], honours: Honours = Honours()) -> None:
    """Refuse `cfg` naming every attribute the family's layers would not honour."""
    found = unhonoured(cfg, honours)
    if found:
        archs = cfg.get("architectures") or [cfg.get("model_type")]
        raise InvalidParameterError(
            "model", f"{archs[0]}'s config.json sets {'; '.join(found)}, which rayvllm does not implement for "
            "this architecture; refused rather than served with wrong tokens",
        )
