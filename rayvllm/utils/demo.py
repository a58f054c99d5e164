"""The embedded demo model: a seeded tiny random Llama, built once into a
cache directory so that every entrypoint works offline with no model given."""

from __future__ import annotations

import os
from pathlib import Path

from rayvllm.utils.paths import cache_dir
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

DEMO_SPEC = RandomModelSpec(
    arch="llama",
    vocab_size=512,  # below the trained BPE size: every id is a real token, output reads as words
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    seed=1234,
)
# Bump when DEMO_SPEC or the builder changes, so stale caches are not reused.
DEMO_VERSION = "4"


def demo_model_path() -> Path:
    """Path of the demo model directory, creating it on first use. Concurrent
    first calls (several processes) build into private temp dirs and rename."""
    target = cache_dir() / f"demo-llama-v{DEMO_VERSION}"
    if (target / ".rayvllm-complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}"
    build_random_model(tmp, DEMO_SPEC)
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process won the race; its copy is identical (same seed).
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
