"""What the rest of the engine may use of a model: the model runner, the
LoRA manager, speculation's proposers, the pooling runner and the loader
call these and nothing else. Every family (models/llama.py and the files
built on it) implements `CausalLM`; models/loader.py's registry maps an HF
architecture name to a class of it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.kernels.metadata import AttentionMetadata
from rayvllm.layers.attention import Attention


class CausalLM(Protocol):
    """This rank's part of a decoder: pipeline stage layers
    `[start_layer, end_layer)` of the checkpoint's, `layers[i]` holding
    global layer `start_layer + i`; a layer's `self_attn.qkv_proj` /
    `o_proj` and `mlp.gate_up_proj` / `down_proj` are the `Linear`s LoRA
    wraps. `stacked_params` names the checkpoint projections those stack
    (our parameter, the checkpoint's projection, its shard id)."""

    start_layer: int
    end_layer: int
    layers: nn.ModuleList
    stacked_params: tuple[tuple[str, str, str], ...]

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The flat batch's final hidden states (the last stage's, normed),
        or `(hidden, residual)` for the next stage; `input_ids` on the
        first stage, `intermediate` on the others."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary float32 logits of `hidden`'s rows on the driver
        rank, None on the others; every TP rank of the last stage calls it."""
        ...

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers in order: the runner binds each one's KV cache."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every parameter from HF-named, full-shape tensors (each rank takes its share)."""
        ...

    def load_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As `load_weights`, into the live model's storage (a weight update)."""
        ...

    def optimize_for_cpu(self, use_c_kernels: bool, fused_kv_write: bool = True, batch_invariant: bool = False) -> None:
        """After loading, float32 on the CPU: GEMM plans and the C kernels."""
        ...

    def optimize_for_gpu(self) -> None:
        """After loading, half precision on CUDA: the fused Triton kernels."""
        ...

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """nn.Module's: the runner moves a sleeping model's weights to the host and back."""
        ...


class CausalLMClass(Protocol):
    """A family's class, as the registry holds it: built from the HF
    config for one rank (`parallel`; None: the whole model), without an LM
    head for a pooling runner."""

    def __call__(
        self, cfg: dict[str, Any], dtype: torch.dtype, parallel: ParallelContext | None = None,
        with_lm_head: bool = True,
    ) -> CausalLM:
        ...
