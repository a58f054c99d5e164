"""What a model directory may make the server execute (docs/RELIABILITY.md):
no Python of its own (`auto_map` in config.json or tokenizer_config.json
is never imported: the model runs on rayvllm's own implementation of its
`architectures`, or is refused; there is no `trust_remote_code`), and a
chat template only inside jinja's sandbox. Each directory here carries a
module that would leave a file behind if anything imported it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rayvllm import LLM, SamplingParams
from rayvllm.messages.errors import InvalidParameterError

ENGINE = dict(max_num_seqs=2, max_model_len=128, kv_cache_memory_bytes=4 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [5, 6, 7, 8, 9, 10]


def _planted(tiny_model_dir: Path, tmp_path: Path, architecture: str | None = None) -> tuple[Path, Path]:
    """A copy of the tiny model whose config.json and tokenizer_config.json
    name classes of `custom_code.py` in `auto_map`; importing that module
    writes the marker file (returned second)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "imported"
    (model / "custom_code.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class CustomConfig(LlamaConfig): pass\n"
        "class CustomModel(LlamaForCausalLM): pass\n"
        "class CustomTokenizer(PreTrainedTokenizerFast): pass\n"
    )
    for name, auto_map in (
        ("config.json", {"AutoConfig": "custom_code.CustomConfig", "AutoModelForCausalLM": "custom_code.CustomModel"}),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "custom_code.CustomTokenizer"]}),
    ):
        data = json.loads((model / name).read_text())
        data["auto_map"] = auto_map
        if name == "config.json" and architecture is not None:
            data["architectures"] = [architecture]
        (model / name).write_text(json.dumps(data))
    return model, marker


def test_auto_map_code_is_never_imported(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A known architecture runs on rayvllm's own implementation, with the
    plain model's tokens (as vLLM and transformers load such a checkpoint
    without trust_remote_code), and its custom module is never imported."""
    model, marker = _planted(tiny_model_dir, tmp_path)
    expected = LLM(model=str(tiny_model_dir), **ENGINE)
    want = expected.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    expected.shutdown()
    llm = LLM(model=str(model), **ENGINE)
    try:
        got = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert got == want
    assert not marker.exists()


def test_an_architecture_only_custom_code_implements_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, marker = _planted(tiny_model_dir, tmp_path, architecture="CustomForCausalLM")
    with pytest.raises(InvalidParameterError, match="CustomForCausalLM"):
        LLM(model=str(model), **ENGINE)
    assert not marker.exists()


def test_trust_remote_code_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidParameterError, match="trust_remote_code"):
        LLM(model=str(tiny_model_dir), trust_remote_code=True, **ENGINE)


def test_a_chat_template_cannot_reach_python(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The model's own template renders in jinja's sandbox: one that reaches
    for Python's internals (to run a shell command) is a 400-class error
    naming the template, and nothing runs."""
    model, marker = _planted(tiny_model_dir, tmp_path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ cycler.__init__.__globals__.os.popen('touch " + str(tmp_path / "escaped") + "').read() }}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(model=str(model), **ENGINE)
    try:
        with pytest.raises(InvalidParameterError, match="chat template"):
            llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not (tmp_path / "escaped").exists() and not marker.exists()
