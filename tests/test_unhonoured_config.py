"""A config.json attribute the Llama-shaped layers do not implement refuses
the model at load, naming the attribute, instead of serving wrong tokens;
each layer's sliding window is read as transformers reads it (the windowed
models' parity: test_sliding_window.py), and a default it leaves out is
the one transformers' class for the model type gives. Configs come from
transformers' own classes, as a checkpoint's config.json would."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from rayvllm.layers.layernorm import RMSNorm
from rayvllm.config import ModelConfig
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from rayvllm.models.honoured import Honours, check_honoured, kv_window, layer_rope, layer_windows, unhonoured
from rayvllm.models.olmo2 import Olmo2ForCausalLM

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


def _config(cls: type, **kwargs: Any) -> dict[str, Any]:
    return cls(**SMALL, **kwargs).to_dict()


@pytest.mark.parametrize(("config", "named"), [
    (_config(transformers.LlamaConfig, hidden_act="gelu"), "hidden_act='gelu'"),
    (_config(transformers.LlamaConfig, mlp_bias=True), "mlp_bias=true"),
    (_config(transformers.LlamaConfig, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 512}), "'yarn'"),
    ({**_config(transformers.LlamaConfig), "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({**_config(transformers.LlamaConfig), "quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quant_method 'gptq'"),
    ({**_config(transformers.LlamaConfig), "query_pre_attn_scalar": 24}, "query_pre_attn_scalar=24"),
    # transformers' OLMo 2 attention takes no window.
    ({**_config(transformers.Olmo2Config), "sliding_window": 16}, "sliding_window=16"),
])
def test_an_unhonoured_attribute_is_refused_by_name(config: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidParameterError, match="refused rather than served with wrong tokens") as refused:
        check_honoured(config)
    assert named in str(refused.value)


@pytest.mark.parametrize(("config", "named"), [
    (_config(transformers.Gemma2Config, hidden_activation="gelu"), "hidden_activation='gelu'"),
    (_config(transformers.Gemma3TextConfig, use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_config(transformers.Gemma3TextConfig, rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "'yarn'"),
])
def test_gemma_refuses_what_its_layers_lack(config: dict[str, Any], named: str) -> None:
    """Gemma's own attributes pass for Gemma (caps, GeGLU, its softmax
    scale); what its layers lack is still refused by name."""
    assert unhonoured(_config(transformers.Gemma2Config), Gemma2ForCausalLM.honours) == []
    with pytest.raises(InvalidParameterError, match="refused rather than served with wrong tokens") as refused:
        check_honoured(config, Gemma3ForCausalLM.honours)
    assert named in str(refused.value)
    # The same Gemma attributes on a family without them are refused.
    assert "attn_logit_softcapping=50.0" in "; ".join(unhonoured(_config(transformers.Gemma2Config), Honours()))


def test_gemma3_rope_per_layer_kind() -> None:
    """Sliding layers on the local base, the full ones on the global base
    with its scaling: from `rope_parameters` keyed by layer kind, and from an
    older config.json's `rope_local_base_freq`."""
    config = _config(transformers.Gemma3TextConfig, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert layer_rope(config, 512) == (1e4, {"rope_type": "default", "rope_theta": 1e4})
    assert layer_rope(config, None) == (1e6, {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6})
    older = {"model_type": "gemma3_text", "num_hidden_layers": 2, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert layer_rope(older, 512) == (1e4, {})
    assert layer_rope(older, None) == (1e6, {"rope_type": "linear", "factor": 8.0})


@pytest.mark.parametrize(("config", "windows", "released"), [
    (_config(transformers.MistralConfig, sliding_window=16), [16] * 4, 16),
    (_config(transformers.MistralConfig, sliding_window=None), [None] * 4, None),
    (_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=2),
     [None, None, 16, 16], None),
    (_config(transformers.Qwen3Config, use_sliding_window=True, sliding_window=16, max_window_layers=0), [16] * 4, 16),
    # Qwen2's window is off unless use_sliding_window, whatever sliding_window says.
    ({**_config(transformers.Qwen2Config, use_sliding_window=False), "sliding_window": 4096}, [None] * 4, None),
    ({**_config(transformers.LlamaConfig), "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, [8, None, 8, None], None),
    (_config(transformers.Gemma2Config, sliding_window=16), [16, None, 16, None], None),
    # Checkpoints saved before transformers wrote layer_types: Gemma's pattern.
    ({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 16}, [16, None, 16, None], None),
    ({"model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 16}, [16] * 5 + [None, 16], None),
    ({"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window": 16, "sliding_window_pattern": 2},
     [16, None, 16, None], None),
])
def test_each_layer_gets_the_window_transformers_gives_it(
    config: dict[str, Any], windows: list[int | None], released: int | None
) -> None:
    """`released`: the window behind which the KV cache manager releases
    blocks, only where no layer reads every key (one block table serves all)."""
    assert layer_windows(config) == windows
    assert kv_window(windows) == released


def test_kv_window_is_the_widest_where_every_layer_has_one() -> None:
    assert kv_window([8, 16, 4]) == 16
    assert kv_window([8, None]) is None
    assert kv_window([]) is None


def test_a_layer_kind_rayvllm_lacks_is_refused() -> None:
    config = {**_config(transformers.LlamaConfig), "layer_types": ["chunked_attention"] * 4}
    with pytest.raises(InvalidParameterError, match="chunked_attention"):
        layer_windows(config)


@pytest.mark.parametrize("config", [
    _config(transformers.LlamaConfig),
    _config(transformers.LlamaConfig, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}),
    _config(transformers.MistralConfig, sliding_window=16),
    _config(transformers.Qwen3Config, use_sliding_window=False),
    _config(transformers.Olmo2Config),
])
def test_what_the_layers_implement_passes(config: dict[str, Any]) -> None:
    assert unhonoured(config) == []


def test_a_norm_eps_left_out_is_olmo2s_default() -> None:
    """A config.json without rms_norm_eps gets transformers' Olmo2Config default (1e-5), not Llama's (1e-6)."""
    config = _config(transformers.Olmo2Config)
    del config["rms_norm_eps"]
    norms = [m for m in Olmo2ForCausalLM(config, torch.float32).modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * 4 + 1  # per layer: q, k, post-attention, post-feedforward; the final norm
    assert {norm.eps for norm in norms} == {transformers.Olmo2Config().rms_norm_eps}


def test_longrope_is_served_only_within_its_original_context() -> None:
    """Phi-3's LongRoPE switches to its long factors past
    original_max_position_embeddings: max_model_len defaults to that
    length, and a longer one is refused by name."""
    config = _config(transformers.Phi3Config, max_position_embeddings=1024, original_max_position_embeddings=256,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    assert unhonoured(config) == []
    assert ModelConfig.from_path("m", None, "float32", None, 0, "cpu", hf_config=config).max_model_len == 256
    with pytest.raises(InvalidParameterError, match="original_max_position_embeddings") as refused:
        ModelConfig.from_path("m", None, "float32", 512, 0, "cpu", hf_config=config)
    assert refused.value.param == "max_model_len"
