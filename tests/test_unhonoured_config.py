"""A config.json attribute the Llama-shaped layers do not implement refuses
the model at load, naming the attribute, instead of serving wrong tokens
(before this, a Mistral config with `sliding_window` was served with full
attention: 0 of 4 prompts matched transformers past the window). Configs
come from transformers' own classes, as a checkpoint's config.json would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers

from rayvllm import LLM
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.models.honoured import check_honoured, unhonoured

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


def _config(cls: type, **kwargs: Any) -> dict[str, Any]:
    return cls(**SMALL, **kwargs).to_dict()


@pytest.mark.parametrize(("config", "named"), [
    (_config(transformers.MistralConfig, sliding_window=16), "sliding_window=16"),
    (_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=2),
     "sliding-window attention on 2 of 4 layers"),
    (_config(transformers.Qwen3Config, use_sliding_window=True, sliding_window=16, max_window_layers=0),
     "sliding-window attention on 4 of 4 layers"),
    (_config(transformers.LlamaConfig, hidden_act="gelu"), "hidden_act='gelu'"),
    (_config(transformers.LlamaConfig, mlp_bias=True), "mlp_bias=true"),
    (_config(transformers.LlamaConfig, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 512}), "'yarn'"),
    ({**_config(transformers.LlamaConfig), "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({**_config(transformers.LlamaConfig), "quantization_config": {"quant_method": "gptq", "bits": 4}},
     "quant_method 'gptq'"),
])
def test_an_unhonoured_attribute_is_refused_by_name(config: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidParameterError, match="refused rather than served with wrong tokens") as refused:
        check_honoured(config)
    assert named in str(refused.value)


@pytest.mark.parametrize("config", [
    _config(transformers.LlamaConfig),
    _config(transformers.LlamaConfig, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}),
    _config(transformers.MistralConfig, sliding_window=None),
    # Qwen2's window is off unless use_sliding_window, whatever sliding_window says.
    {**_config(transformers.Qwen2Config, use_sliding_window=False), "sliding_window": 4096},
    _config(transformers.Qwen3Config, use_sliding_window=False),
    # A window on no layer (max_window_layers past the last) changes nothing.
    {**_config(transformers.Qwen2Config), "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4,
     "layer_types": None},
])
def test_what_the_layers_implement_passes(config: dict[str, Any]) -> None:
    assert unhonoured(config) == []


def test_a_windowed_mistral_is_refused_at_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "mistral"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidParameterError, match="sliding_window=16"):
        LLM(model=str(model), max_model_len=64, kv_cache_memory_bytes=1 << 20)
