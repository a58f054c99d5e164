"""Build a model from an HF directory: architecture lookup, then safetensors weights."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.kernels import cpu_ops
from rayvllm.kernels.backends import fused_gpu_kernels_apply
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from rayvllm.models.interface import CausalLM, CausalLMClass
from rayvllm.models.llama import (
    GraniteForCausalLM, LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
)
from rayvllm.models.olmo2 import Olmo2ForCausalLM

# HF architecture name -> the family's class (adding a family: docs/ARCHITECTURE.md, "Models").
MODEL_REGISTRY: dict[str, CausalLMClass] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def _model_class(arch: str) -> CausalLMClass | None:
    """A registered architecture, or the bare decoder of one (`Qwen2Model`:
    the same layers without LM head, whose weights lack the "model."
    prefix), which the pooling runner loads as its model without LM head."""
    if arch in MODEL_REGISTRY:
        return MODEL_REGISTRY[arch]
    if arch.endswith("Model"):
        return MODEL_REGISTRY.get(arch.removesuffix("Model") + "ForCausalLM")
    return None


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidParameterError("model", f"no safetensors weights in {str(model_dir)!r}")
    return files


def iterate_weights(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def checkpoint_spec(model_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each checkpoint tensor's HF name -> (shape, dtype), read from the
    safetensors headers alone (no tensor is loaded): what a weight update
    must match (worker/weight_transfer.py)."""
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for path in _weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                spec[name] = (tuple(view.get_shape()), _SAFETENSORS_DTYPES[view.get_dtype()])
    return spec



def load_model(
    model_dir: str,
    hf_config: dict,
    dtype: torch.dtype,
    device: str = "cpu",
    parallel: ParallelContext | None = None,
    fused_kv_write: bool = True,
    with_lm_head: bool = True,
    batch_invariant: bool = False,
) -> CausalLM:
    """This rank's part of the model (all of it without `parallel`), from
    the checkpoint in `model_dir` (`build_model` says the rest)."""
    weights = iterate_weights(Path(model_dir), dtype)
    return build_model(hf_config, dtype, weights, device, parallel, fused_kv_write, with_lm_head)


def build_model(
    hf_config: dict,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: str = "cpu",
    parallel: ParallelContext | None = None,
    fused_kv_write: bool = True,
    with_lm_head: bool = True,
    batch_invariant: bool = False,
) -> CausalLM:
    """This rank's part of the model, its parameters taken from `weights`
    (HF names and full shapes; each rank slices its part).

    Parameters are created in `dtype` on `device` directly: a float32
    model converted afterwards would need twice the weights' memory on a
    GPU for a moment. `fused_kv_write`: the attention backend lets the
    float32 CPU model store K/V with its fused RoPE kernel. `with_lm_head`:
    False for a pooling runner, which never computes logits (a checkpoint's
    LM head is then skipped, and may be absent). `batch_invariant`: every
    GEMM on the C kernel (EngineConfig.deterministic)."""
    archs = hf_config.get("architectures") or []
    cls = next((c for c in map(_model_class, archs) if c is not None), None)
    if cls is None:
        raise InvalidParameterError(
            "model",
            f"architectures {archs} not supported; supported: {', '.join(MODEL_REGISTRY)} "
            "(and, to pool, their bare decoders: LlamaModel, ...)",
        )
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config, dtype, parallel, with_lm_head=with_lm_head).to(dtype)
    model.load_weights(weights)
    if device == "cpu" and dtype == torch.float32:
        model.optimize_for_cpu(
            use_c_kernels=cpu_ops.available(), fused_kv_write=fused_kv_write, batch_invariant=batch_invariant
        )
    elif fused_gpu_kernels_apply(device, dtype):
        model.optimize_for_gpu()
    return model.eval()
