"""transformers as the correctness oracle: greedy continuations of the test
models, computed once per (model, prompt, device) and shared by the test
modules."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

NUM_NEW = 24

_CACHE: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def hf_greedy(model_dir: Path, prompt: list[int], device: str = "cpu") -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generate in float32 on `device`; returns the
    tokens and the per-step log-softmax (on the CPU)."""
    key = (str(model_dir), tuple(prompt), device)
    if key not in _CACHE:
        model = hf_model(model_dir, device)
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        assert len(tokens) == NUM_NEW
        logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1).cpu()
        _CACHE[key] = (tokens, logprobs)
    return _CACHE[key]


_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def hf_model(model_dir: Path, device: str = "cpu") -> torch.nn.Module:
    key = (str(model_dir), device)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return _MODELS[key]


def hf_embedding(model_dir: Path, prompt: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    """transformers' final hidden states (after the last norm) of `prompt`,
    pooled: the last token's, or the mean over the prompt; L2-normalised
    when `normalize`."""
    with torch.no_grad():
        hidden = hf_model(model_dir).model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, p=2, dim=-1) if normalize else vector
