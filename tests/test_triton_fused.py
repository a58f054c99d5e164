"""kernels/triton_fused.py against torch's op-by-op arithmetic (the layers'
own eager paths), under Triton's interpreter on a CPU-only machine and
natively on a GPU; and a model with the fused kernels switched on keeps
transformers' greedy tokens. In half precision the interpreter truncates
where a GPU rounds to nearest, and RoPE's difference of two rounded
products carries its operands' rounding (values up to ~4 here), so half
results are compared within a few units in the last place of 4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rayvllm import LLM, SamplingParams
from rayvllm.kernels import triton_fused
from rayvllm.kernels.backends import fused_gpu_kernels_apply
from rayvllm.layers.layernorm import RMSNorm
from rayvllm.layers.rotary import RotaryEmbedding
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

from hf_oracle import hf_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2 ** -4, rtol=2 ** -6),
    torch.float16: dict(atol=2 ** -7, rtol=2 ** -9),
}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _norm(size: int, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * _randn(size, dtype=torch.float32, seed=seed).cpu())
    return norm.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_add_rms_norm_matches_the_eager_norm(dtype: torch.dtype, with_residual: bool) -> None:
    # 96 columns: a row narrower than the kernel's power-of-two block.
    x, residual = _randn(5, 96, dtype=dtype, seed=1), _randn(5, 96, dtype=dtype, seed=2)
    before = (x.clone(), residual.clone())
    norm = _norm(96, dtype, seed=3)
    if with_residual:
        expected = norm.forward_with_residual(x, residual)
        got = triton_fused.add_rms_norm(x, residual, norm.weight, norm.eps)
    else:
        expected = (norm(x), x)
        got = triton_fused.add_rms_norm(x, None, norm.weight, norm.eps)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])
    # The inputs are left as they were: a CUDA graph's static buffers may be among them.
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("with_norm", [True, False], ids=["qk-norm", "rope-only"])
def test_norm_rope_matches_norm_then_rotary(dtype: torch.dtype, head_dim: int, with_norm: bool) -> None:
    """On q as the model has it: a strided view into the fused QKV output."""
    tokens, heads, kv_heads = 6, 4, 2
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 40, 63], device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None, dtype).to(DEVICE)
    norm = _norm(head_dim, dtype, seed=5) if with_norm else None
    expected, _ = rotary(positions, norm(q) if norm is not None else q, q)
    got = triton_fused.norm_rope(
        q, positions, rotary.cos, rotary.sin, norm.weight if norm is not None else None, 1e-6
    )
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    gate_up = _randn(7, 2 * 80, dtype=dtype, seed=6)
    gate, up = gate_up.split(80, dim=-1)
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


def test_fused_kernels_apply_to_half_precision_on_cuda_only() -> None:
    assert fused_gpu_kernels_apply("cuda", torch.bfloat16) and fused_gpu_kernels_apply("cuda:0", torch.float16)
    assert not fused_gpu_kernels_apply("cuda", torch.float32)  # the parity mode keeps torch's ops
    assert not fused_gpu_kernels_apply("cpu", torch.bfloat16)


@pytest.mark.parametrize("arch", ["qwen3", "olmo2"])
def test_model_with_fused_kernels_keeps_greedy_parity(tmp_path: Path, arch: str) -> None:
    """The kernels switched on in a model with q/k norms (Qwen3's per head,
    fused with RoPE; OLMo 2's over all heads, before a RoPE-only kernel) in
    float32, eager: the layers' wiring gives transformers' greedy tokens."""
    spec = RandomModelSpec(
        arch=arch, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, norm_weight_std=0.3, seed=23
    )
    model_dir = build_random_model(tmp_path / arch, spec)
    llm = LLM(model=str(model_dir), device=DEVICE, dtype="float32", max_num_seqs=2, max_model_len=128,
              enforce_eager=True)
    model = llm.llm_engine.engine_core.engine_core.executor.runner.model
    model.optimize_for_gpu()
    assert model.layers[0].self_attn.use_triton_kernels and model.layers[0].mlp.use_triton_kernel
    prompts = [[5, 9, 200, 31], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, device=DEVICE)[0][:6]
