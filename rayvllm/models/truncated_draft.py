"""A draft model cut from a target: its embeddings, first layers, final
norm and LM head (the layer-skipping kind of draft), saved beside the
target's tokenizer, so it shares the vocabulary by construction. For
speculative-decoding tests and benchmarks, where no hub offers a draft."""

from __future__ import annotations

import json
from pathlib import Path


def build_truncated_draft(target: str | Path, path: str | Path, num_layers: int = 1) -> Path:
    """Create (or reuse, if complete) a draft of `target` at `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    marker = path / ".rayvllm-complete"
    if marker.exists():
        return path
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    if not 1 <= num_layers <= model.config.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{model.config.num_hidden_layers}, got {num_layers}")
    settings = model.config.to_dict()
    # A per-layer list (a windowed family's layer_types) keeps the draft's layers' entries.
    kept_types = {"layer_types": settings["layer_types"][:num_layers]} if settings.get("layer_types") else {}
    config = model.config.__class__.from_dict({**settings, "num_hidden_layers": num_layers, **kept_types})
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kept = {
        name: tensor for name, tensor in model.state_dict().items()
        if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < num_layers
    }
    draft.load_state_dict(kept, strict=True)
    path.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(str(path), safe_serialization=True)
    AutoTokenizer.from_pretrained(target).save_pretrained(str(path))
    marker.write_text(json.dumps({"target": str(target), "num_layers": num_layers}))
    return path
