"""transformers as the correctness oracle: greedy continuations of the test
models, computed once per (model, prompt) and shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

NUM_NEW = 24

_CACHE: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def hf_greedy(model_dir: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generate; returns tokens and per-step log-softmax."""
    key = (str(model_dir), tuple(prompt))
    if key not in _CACHE:
        model = hf_model(model_dir)
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        assert len(tokens) == NUM_NEW
        logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
        _CACHE[key] = (tokens, logprobs)
    return _CACHE[key]


_MODELS: dict[str, torch.nn.Module] = {}


def hf_model(model_dir: Path) -> torch.nn.Module:
    if str(model_dir) not in _MODELS:
        _MODELS[str(model_dir)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _MODELS[str(model_dir)]


def hf_embedding(model_dir: Path, prompt: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of `prompt`,
    pooled: the last token's, or the mean over the prompt; L2-normalised
    when `normalize`."""
    with torch.no_grad():
        hidden = hf_model(model_dir).model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, p=2, dim=-1) if normalize else vector
