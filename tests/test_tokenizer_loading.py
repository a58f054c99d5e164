"""`get_tokenizer` loads a directory whose tokenizer config names the plain
tokenizers backend without `AutoTokenizer` (which imports the model's
config module, and with it torch.distributed.tensor): the tokenizer it
returns is the one `AutoTokenizer` returns, token for token, and the
directories where transformers would choose another class go through
`AutoTokenizer` as before."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rayvllm.utils.demo import demo_model_path
from rayvllm.utils.random_model import RandomModelSpec, build_random_model
from rayvllm.utils.tokenizer import _is_plain_backend, get_tokenizer

TEXTS = ["Hello, my name is", "  spaces\tand\nlines  ", "<|im_start|>user\nhi<|im_end|>", "émoji 🙂 ünïcode", ""]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {
        arch: build_random_model(root / arch, RandomModelSpec(arch=arch, seed=5)) for arch in ("llama", "qwen2", "qwen3")
    }
    return {"demo": demo_model_path(), **dirs}


def _edited(source: Path, target: Path, file: str, **changes: object) -> Path:
    shutil.copytree(source, target)
    data = json.loads((target / file).read_text())
    data.update(changes)
    (target / file).write_text(json.dumps(data))
    return target


def test_which_directories_skip_auto_tokenizer(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    # qwen2 is on transformers' list of model types whose declared class it overrides.
    assert {name: _is_plain_backend(path) for name, path in model_dirs.items()} == {
        "demo": True, "llama": True, "qwen2": False, "qwen3": True,
    }
    llama = model_dirs["llama"]
    assert not _is_plain_backend(_edited(llama, tmp_path / "remote", "tokenizer_config.json",
                                         auto_map={"AutoTokenizer": ["x.Tok", None]}))
    assert not _is_plain_backend(_edited(llama, tmp_path / "named", "tokenizer_config.json",
                                         tokenizer_class="Qwen2Tokenizer"))
    assert not _is_plain_backend(_edited(llama, tmp_path / "phi3", "config.json", model_type="phi3"))
    assert not _is_plain_backend(tmp_path / "missing")
    listed = shutil.copytree(llama, tmp_path / "listed")
    (listed / "config.json").write_text("[]")
    assert not _is_plain_backend(listed)


@pytest.mark.parametrize("name", ["demo", "llama", "qwen2", "qwen3"])
def test_the_tokenizer_is_auto_tokenizers(model_dirs: dict[str, Path], name: str) -> None:
    path = model_dirs[name]
    ours, auto = get_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.all_special_ids == auto.all_special_ids
    assert ours.chat_template == auto.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                        auto.pad_token_id)
    for text in TEXTS:
        ids = auto.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == auto.decode(ids)
        assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)


def test_transformers_tables_read_from_its_source_equal_its_own() -> None:
    """The two tables `_is_plain_backend` needs, parsed from transformers'
    source, are the ones its module holds: every model type (or name) whose
    class it overrides, and every model type it maps to MistralCommonBackend
    (plus those it maps there only with mistral_common installed)."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    from rayvllm.utils.tokenizer import _auto_tokenizer_exceptions

    overridden, mistral = _auto_tokenizer_exceptions()
    assert overridden == frozenset(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    assert {k for k, v in TOKENIZER_MAPPING_NAMES.items() if v == "MistralCommonBackend"} <= mistral
    assert mistral and mistral <= set(TOKENIZER_MAPPING_NAMES)


def test_a_plain_directory_loads_without_transformers_model_index(model_dirs: dict[str, Path]) -> None:
    """In a fresh process, loading the demo model's tokenizer leaves
    `transformers.models.auto` unimported (its import indexes every model)."""
    script = (
        "import sys; from rayvllm.utils.tokenizer import get_tokenizer; get_tokenizer(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))"
    )
    result = subprocess.run([sys.executable, "-c", script, str(model_dirs["demo"])], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
