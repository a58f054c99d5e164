"""Shared pytest fixtures.

Keep this file to fixtures that several test modules need; a fixture used by
one module belongs in that module. Expensive fixtures are session-scoped and
build into pytest's tmp dirs, never into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter. `@triton.jit`
    # reads the variable when it decorates, i.e. when a kernel module is first
    # imported, and conftest is imported before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with the default `RandomModelSpec` (vocab 4096, ids 0..4
    are <unk>, <s>, </s>, <|im_start|>, <|im_end|>; chat template included),
    built once per test session. Treat it as read-only."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    return build_random_model(tmp_path_factory.mktemp("tiny_model"), RandomModelSpec())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> "PreTrainedTokenizerBase":
    """The fast tokenizer of `tiny_model_dir`, loaded once. Do not mutate it
    (use monkeypatch for temporary attribute changes)."""
    from rayvllm.utils.tokenizer import get_tokenizer

    return get_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def no_ray_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """This environment plus a `ray` package that cannot be imported, first
    on PYTHONPATH: a script run with it, and its children, see no Ray, as on
    the GPU benchmark machine."""
    fake = tmp_path_factory.mktemp("no_ray") / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("ray is blocked in this test")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(fake.parent), env.get("PYTHONPATH", "")) if p)
    return env


def _damped_model(base: Path, path: Path, scale: float) -> Path:
    """`base` with its last layer's residual contributions scaled by
    `scale`: a draft cut from its other layers then agrees with it often,
    but not always, which is what a test of acceptance and rejection wants."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        last = model.model.layers[-1]
        last.self_attn.o_proj.weight.mul_(scale)
        last.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def draft_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft) for speculative decoding: a 2-layer random Llama
    (its second layer damped) and the 1-layer draft cut from it, sharing
    the tokenizer. Treat both as read-only."""
    from rayvllm.models.truncated_draft import build_truncated_draft
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    root = tmp_path_factory.mktemp("spec_models")
    base = build_random_model(root / "base", RandomModelSpec(num_hidden_layers=2, seed=31))
    target = _damped_model(base, root / "target", 0.1)
    return target, build_truncated_draft(target, root / "draft", 1)
