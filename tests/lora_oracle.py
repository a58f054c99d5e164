"""PEFT as the LoRA oracle: adapters built locally on the test models with
random A and B (so they change the output), and transformers + PEFT's
greedy continuations under them."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from hf_oracle import NUM_NEW

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    model_dir: Path, out_dir: Path, seed: int, rank: int = 8, alpha: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter directory for `model_dir`, A and B random
    (`init_lora_weights=False`), saved as safetensors."""
    if not (out_dir / "adapter_config.json").exists():
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
            init_lora_weights=False, use_rslora=use_rslora,
        )
        get_peft_model(base, config).save_pretrained(out_dir)
    return out_dir


_CACHE: dict[tuple[str, str | None, tuple[int, ...]], list[int]] = {}


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> list[int]:
    """NUM_NEW greedy tokens of transformers (+ PEFT with `adapter_dir`) in float32."""
    key = (str(model_dir), str(adapter_dir) if adapter_dir else None, tuple(prompt))
    if key not in _CACHE:
        # A fresh base each time: PEFT injects its layers into the model it wraps.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        if adapter_dir is not None:
            model = PeftModel.from_pretrained(model, adapter_dir).eval()
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
            )
        _CACHE[key] = out[0, len(prompt):].tolist()
    return _CACHE[key]
