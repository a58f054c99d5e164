"""A trainer's side for the RL control-plane tests: weights a training step
could have produced (the test model's, moved by seeded noise), saved as a
checkpoint for a fresh engine to load, and a worker extension that
`collective_rpc` reaches (`worker_extension_cls="rl_oracle:WeightProbe"`;
Ray workers import it from the driver's path, as fault_hooks.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def trained_weights(model_dir: Path, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The model's HF state dict with every tensor moved by seeded noise
    (a step's update: the greedy tokens change)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std().clamp(min=1e-3))
    return {name: t.clone() for name, t in model.state_dict().items()}


def save_weights(model_dir: Path, weights: dict[str, torch.Tensor], path: Path) -> Path:
    """A checkpoint of `weights` beside `model_dir`'s config and tokenizer:
    what a fresh engine loads to be compared with a synced one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(weights)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(path))
    return path


class WeightProbe:
    """Mixed into every worker: what its model holds now."""

    def embedding_sum(self: Any) -> float:
        return float(self.runner.model.embed_tokens.weight.detach().double().sum())

    def tp_rank(self: Any) -> int:
        return int(self.parallel.tp_rank)


class Clash:
    """An extension that would replace a worker method: refused."""

    def load_model(self) -> None:
        raise AssertionError("never called")
