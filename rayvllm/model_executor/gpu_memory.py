"""Sizing the KV cache on a GPU from a profiled forward at the maximum batch.

The rule (vLLM's): this engine may use `gpu_memory_utilization` of the
device's total memory; what the KV cache gets is that share minus what
everything else needs at its worst: the weights, the peak activations of a
forward over `max_num_batched_tokens` tokens plus the sampler over
`max_num_seqs` rows, and memory torch does not manage (the CUDA context,
NCCL and kernel-library workspaces, other processes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes measured around one profiling forward."""

    total: int
    weights: int
    peak_activations: int
    non_torch: int


def kv_cache_budget(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache; negative when nothing is."""
    used = profile.non_torch + profile.peak_activations + profile.weights
    return int(profile.total * gpu_memory_utilization) - used


def profile_memory(device: torch.device, run: Callable[[], None]) -> MemoryProfile:
    """Call `run` (the worst-case forward and sampling) and measure. Every
    torch allocation alive before it (the weights, and buffers such as the
    rotary tables) counts as weights; what it allocates on top at its peak
    counts as activations."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    free, total = torch.cuda.mem_get_info(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, weights=weights, peak_activations=peak, non_torch=non_torch)
