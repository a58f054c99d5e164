"""GPU setup that can be checked on the CPU: the KV budget arithmetic, the
profiling step itself, and the dtype rules for weights and KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.config import resolve_dtype
from rayvllm.models.loader import load_model
from rayvllm.model_executor.gpu_memory import MemoryProfile, kv_cache_budget, profile_memory

GiB = 1 << 30


def test_kv_cache_budget_arithmetic() -> None:
    profile = MemoryProfile(total=80 * GiB, weights=16 * GiB, peak_activations=3 * GiB, non_torch=GiB)
    # 90% of 80 GiB = 72 GiB, minus 16 + 3 + 1.
    assert kv_cache_budget(profile, 0.9) == 52 * GiB
    assert kv_cache_budget(profile, 0.2) == -4 * GiB  # nothing left: the caller refuses to start


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profile_run_is_the_largest_step_and_writes_no_kv(
    tiny_model_dir: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        model=str(tiny_model_dir), attention_backend=backend, max_num_seqs=4, max_model_len=256,
        max_num_batched_tokens=48, kv_cache_memory_bytes=8 << 20,
    )
    runner = llm.llm_engine.engine_core.engine_core.executor.runner
    seen: list[int] = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, *a: seen.append(ids.shape[0]) or forward(ids, *a))
    sampled: list[int] = []
    sampler = runner.sampler
    monkeypatch.setattr(runner, "sampler", lambda logits, md: sampled.append(logits.shape[0]) or sampler(logits, md))
    runner.profile_run()
    assert seen == [48] and sampled == [4]
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


def test_auto_dtype_follows_the_checkpoint_on_cuda_only() -> None:
    """vLLM's rule: half checkpoints stay half on CUDA, float32 stays float32,
    and the CPU computes in float32 unless told otherwise."""
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cuda") == "bfloat16"
    assert resolve_dtype("auto", {"dtype": "float16"}, "cuda") == "float16"
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == "float32"
    assert resolve_dtype("auto", {}, "cuda") == "float32"
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cpu") == "float32"
    assert resolve_dtype("float16", {"torch_dtype": "float32"}, "cuda") == "float16"
    assert resolve_dtype("half", {}, "cpu") == "float16"
    # A torch.dtype given directly is named as torch names it.
    assert resolve_dtype(torch.bfloat16, {}, "cpu") == "bfloat16"
    assert getattr(torch, resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cuda")) == torch.bfloat16


def test_weights_are_created_in_the_target_dtype(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No transient float32 copy of the model (on a GPU that would need twice
    the weights' memory): parameters are born bfloat16."""
    from rayvllm.config import ModelConfig

    created: list[torch.dtype] = []
    empty = torch.empty

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        created.append(t.dtype)
        return t

    config = ModelConfig.from_path(str(tiny_model_dir), None, "bfloat16", 256, 0, "cpu")
    monkeypatch.setattr(torch, "empty", spy)
    model = load_model(config.model, config.hf_config, torch.bfloat16)
    monkeypatch.undo()
    assert created and set(created) == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiled_kv_budget_on_cuda(tiny_model_dir: Path) -> None:
    """The profile sees the weights, a nonzero activation peak and the CUDA
    context; the engine then sizes its pool from it (no explicit budget)."""
    llm = LLM(model=str(tiny_model_dir), max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.5)
    runner = llm.llm_engine.engine_core.engine_core.executor.runner
    profile = profile_memory(runner.device, runner.profile_run)
    assert profile.total == torch.cuda.mem_get_info(runner.device)[1]
    assert profile.weights > 0 and profile.peak_activations > 0 and profile.non_torch > 0
    assert kv_cache_budget(profile, 0.5) > 0
    assert llm.llm_engine.config.cache_config.num_blocks >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bfloat16_checkpoint_runs_in_bfloat16_on_cuda(tmp_path: Path) -> None:
    """"auto" keeps a bfloat16 checkpoint in bfloat16 on CUDA: weights, KV
    cache and the chosen GPU backend; tokens come out."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    model_dir = build_random_model(tmp_path / "bf16", RandomModelSpec(dtype="bfloat16"))
    llm = LLM(model=str(model_dir), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.engine_core.engine_core.executor.runner
    assert runner.dtype == torch.bfloat16 and runner.attn_backend.name in ("triton", "flash_attn")
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    out = llm.generate("hello ray", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
