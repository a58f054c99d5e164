"""Exact greedy parity with transformers (float32, CPU) through the whole engine:
scheduler, KV cache manager, paged attention, sampler, output processing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

from hf_oracle import NUM_NEW, hf_greedy as _hf_greedy

SPECS = {
    "llama-gqa": RandomModelSpec(arch="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, seed=1),
    "llama-mha-tied": RandomModelSpec(
        arch="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, seed=2
    ),
    "llama3-rope": RandomModelSpec(
        arch="llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        seed=3,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        rope_theta=500000.0,
    ),
    "qwen2-gqa": RandomModelSpec(arch="qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, seed=4),
    "qwen3-gqa-tied": RandomModelSpec(
        arch="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=True, seed=5,
    ),
    # Granite's scalings, far from 1 so that a missed one changes the tokens.
    "granite": RandomModelSpec(
        arch="granite", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, seed=7,
        extra={"embedding_multiplier": 6.0, "attention_multiplier": 0.0625, "residual_multiplier": 0.4,
               "logits_scaling": 4.0},
    ),
    # Phi-3: its checkpoint fuses q/k/v and gate/up.
    "phi3": RandomModelSpec(arch="phi3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, seed=8),
    # Phi-3's LongRoPE (per-frequency short factors, cos and sin scaled), served up to its original context.
    "phi3-longrope": RandomModelSpec(
        arch="phi3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, seed=9,
        max_position_embeddings=1024, extra={"original_max_position_embeddings": 256},
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(16)],
                      "long_factor": [4.0 + 0.2 * i for i in range(16)]},
    ),
    # OLMo 2: norms after each sublayer, q/k normed over all heads. Norm weights away from 1, so that one
    # loaded into the wrong rows changes the tokens; an explicit head_dim (48, not 128 / 4).
    "olmo2-gqa": RandomModelSpec(
        arch="olmo2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, norm_weight_std=0.3, seed=9,
    ),
    "olmo2-mha-tied": RandomModelSpec(
        arch="olmo2", hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=48,
        tie_word_embeddings=True, norm_weight_std=0.3, seed=10,
    ),
    "qwen3-mha-sharded": RandomModelSpec(
        arch="qwen3", hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, seed=6,
        max_shard_size="1MB",
    ),
}


@pytest.fixture(scope="session")
def parity_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parity-models")
    return {name: build_random_model(root / name, spec) for name, spec in SPECS.items()}


def _prompts(seed: int, n: int = 8, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 4000) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(5, 4000) for _ in range(rng.randint(3, 70))] for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], logprobs: int | None = None) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_parity_default(parity_models: dict[str, Path], name: str) -> None:
    model_dir = parity_models[name]
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=16)
    prompts = _prompts(seed=10)
    outputs = _generate(llm, prompts, logprobs=3)
    for prompt, out in zip(prompts, outputs):
        tokens, hf_logprobs = _hf_greedy(model_dir, prompt)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        assert completion.finish_reason == "length"
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            assert abs(entry[token].logprob - hf_logprobs[step, token].item()) < 1e-4
            top = torch.topk(hf_logprobs[step], 3)
            for tok, val in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[tok].logprob - val) < 1e-4


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-gqa-tied", "granite", "olmo2-gqa"])
def test_greedy_parity_chunked_prefill(parity_models: dict[str, Path], name: str) -> None:
    model_dir = parity_models[name]
    llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=16, max_num_seqs=8)
    prompts = _prompts(seed=11)
    assert max(len(p) for p in prompts) > 16  # some prompt really is chunked
    outputs = _generate(llm, prompts)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _hf_greedy(model_dir, prompt)[0]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-gqa"])
def test_greedy_parity_under_preemption(parity_models: dict[str, Path], name: str) -> None:
    model_dir = parity_models[name]
    # 24 usable blocks of 16 tokens for 8 sequences of up to ~94 tokens each:
    # they cannot all stay resident, so the scheduler must preempt and recompute.
    llm = LLM(
        model=str(model_dir), dtype="float32", num_gpu_blocks_override=25, max_model_len=256,
        enable_prefix_caching=False,
    )
    prompts = _prompts(seed=12)
    outputs = _generate(llm, prompts)
    assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == _hf_greedy(model_dir, prompt)[0]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-mha-sharded", "olmo2-gqa"])
def test_greedy_parity_with_prefix_cache_hits(parity_models: dict[str, Path], name: str) -> None:
    model_dir = parity_models[name]
    llm = LLM(model=str(model_dir), dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=64)
    prompts = _prompts(seed=13, shared_prefix=100)
    first = _generate(llm, prompts)
    core = llm.llm_engine.engine_core
    core.make_stats()
    second = _generate(llm, prompts)
    stats = core.make_stats().prefix_cache_stats
    # Every prompt's full blocks are cached by the first pass.
    assert stats.hits >= sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert all(o.num_cached_tokens > 0 for o in second)
    for prompt, a, b in zip(prompts, first, second):
        expected = _hf_greedy(model_dir, prompt)[0]
        assert a.outputs[0].token_ids == expected
        assert b.outputs[0].token_ids == expected


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-gqa-tied"])
def test_greedy_parity_async_scheduling(parity_models: dict[str, Path], name: str) -> None:
    """Async scheduling (the next step scheduled against tokens still being
    sampled) computes exactly what the synchronous engine does, through
    chunked prefill, preemption and prefix-cache hits; run in-process, where
    the executor finishes each step on submission, so the scheduler's
    bookkeeping is what is tested."""
    model_dir = parity_models[name]
    llm = LLM(
        model=str(model_dir), dtype="float32", async_scheduling=True, max_num_batched_tokens=32,
        num_gpu_blocks_override=30, max_model_len=256, enable_prefix_caching=True,
    )
    core = llm.llm_engine.engine_core.engine_core
    assert core.max_inflight == 2
    prompts = _prompts(seed=14, shared_prefix=40)
    first = _generate(llm, prompts)
    second = _generate(llm, prompts)
    assert core.scheduler.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in second)
    for prompt, a, b in zip(prompts, first, second):
        expected = _hf_greedy(model_dir, prompt)[0]
        assert a.outputs[0].token_ids == expected
        assert b.outputs[0].token_ids == expected
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_async_scheduling_stops_where_sync_does(parity_models: dict[str, Path]) -> None:
    """Requests that stop early (a stop token id, a max_tokens limit, n > 1)
    end with the same tokens and reasons as without async scheduling: the
    extra token computed past a stop is dropped."""
    model_dir = parity_models["llama-gqa"]
    prompts = _prompts(seed=15, n=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    reference = LLM(model=str(model_dir), dtype="float32", max_num_seqs=8)
    full = reference.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    # Each prompt stops at a token it produces mid-way, or at a short max_tokens.
    params = [
        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop_token_ids=[o.outputs[0].token_ids[3 + i]])
        if i % 2 == 0
        else SamplingParams(temperature=0.0, max_tokens=2 + i)
        for i, o in enumerate(full)
    ]
    params[-1] = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=9)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    expected = reference.generate(inputs, params, use_tqdm=False)
    llm = LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, async_scheduling=True)
    got = llm.generate(inputs, params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        assert [(c.finish_reason, c.stop_reason) for c in g.outputs] == [
            (c.finish_reason, c.stop_reason) for c in e.outputs
        ]
    assert any(len(e.outputs[0].token_ids) < NUM_NEW and e.outputs[0].finish_reason == "stop" for e in expected)
    assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.usage == 0.0
