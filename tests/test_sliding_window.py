"""Sliding-window attention, exact against transformers (float32, CPU):
Mistral and Phi-3 with a window on every layer, Qwen2 with
`use_sliding_window` on the layers from `max_window_layers` on, Gemma 2
and 3 with local layers between global ones. The window (8 keys) is far shorter
than the prompts plus the 24 tokens generated, so every prompt runs past
it; through the whole engine, with chunked prefill and prefix-cache hits
(before this, a windowed Mistral was served with full attention: 0 of 4
prompts matched transformers). On float32 CPU the decodes (and on AVX-512
the prefills) run in the C attention kernels, which start at the window.
Where every layer has the window (Mistral, Phi-3) the KV cache manager
releases the blocks behind it, which no attention path may read again: a
long request holds a window's worth of blocks; Qwen2's full-attention
layer (and Gemma's) keep them all."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.core.block_pool import KVCacheBlock
from rayvllm.kernels import cpu_attention
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

from bench_scripts import load_bench_script
from hf_oracle import NUM_NEW, hf_greedy

WINDOW = 8
SPECS = {
    "mistral": RandomModelSpec(arch="mistral", seed=11, extra={"sliding_window": WINDOW}),
    # Phi-3-mini's checkpoints ship a window (2,047 keys) on every layer.
    "phi3": RandomModelSpec(arch="phi3", seed=14, extra={"sliding_window": WINDOW}),
    "qwen2": RandomModelSpec(
        arch="qwen2", seed=12, num_hidden_layers=3,
        extra={"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    # Gemma 2: local layers between global ones, soft caps low enough to
    # bite, a softmax scale that is not 1 / sqrt(head_dim).
    "gemma2": RandomModelSpec(
        arch="gemma2", seed=15, num_hidden_layers=3, head_dim=32, norm_weight_std=0.2,
        extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.0,
               "final_logit_softcapping": 1.5},
    ),
    # Gemma 3: q/k norms, a local RoPE base on the sliding layers and another on the full one.
    "gemma3": RandomModelSpec(
        arch="gemma3", seed=16, num_hidden_layers=3, head_dim=32, rope_theta=1e6, norm_weight_std=0.2,
        extra={"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "rope_local_base_freq": 10000.0,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    ),
}
# With each chosen token's logprob: a cap on the final logits (Gemma 2) keeps their order, not their values.
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def windowed_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed")
    return {name: build_random_model(root / name, spec) for name, spec in SPECS.items()}


def _prompts(seed: int, lengths: tuple[int, ...], prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(5, 4000) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("mode", ["default", "chunked", "prefix_cached"])
def test_windowed_greedy_parity(windowed_models: dict[str, Path], name: str, mode: str) -> None:
    model = windowed_models[name]
    engine: dict[str, object] = dict(max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    prompts = _prompts(1, (5, 13, 40))
    if mode == "chunked":
        engine.update(max_num_batched_tokens=16, enable_chunked_prefill=True)
    if mode == "prefix_cached":
        shared = _prompts(2, (37,))[0]
        prompts = [shared + p for p in _prompts(3, (3, 9))]
        engine.update(enable_prefix_caching=True)
    llm = LLM(model=str(model), **engine)
    # One block table serves every layer: only a window on all of them lets blocks go.
    assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.sliding_window == (
        WINDOW if name in ("mistral", "phi3") else None
    )
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.runner
        # Windowed layers take the C attention kernels wherever the shape does.
        assert runner.use_c_decode == cpu_attention.supports(runner.model_config.head_dim, runner.block_size)
        if mode == "prefix_cached":
            llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)  # caches the shared blocks
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    if mode == "prefix_cached":
        assert outs[1].num_cached_tokens >= 32
    for prompt, out in zip(prompts, outs):
        tokens, hf_logprobs = hf_greedy(model, prompt)
        assert list(out.outputs[0].token_ids) == tokens, (name, mode, len(prompt))
        for step, (token, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            assert abs(entry[token].logprob - hf_logprobs[step, token].item()) < 1e-4, (name, mode, step)


@pytest.mark.parametrize(("name", "backend", "num_new"), [
    ("mistral", "torch", NUM_NEW), ("phi3", "torch", NUM_NEW), ("mistral", "triton", 12),
])
def test_released_blocks_are_never_read(
    windowed_models: dict[str, Path], name: str, backend: str, num_new: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block the pool takes back, behind a window or at a request's
    end, is filled with NaN in every layer's cache at once (no prefix
    caching, so none is a hit later): the tokens still match transformers
    through chunked prefill over a cached prefix and decode, on the torch
    path and in the Triton kernel (its interpreter here, hence fewer
    tokens), so no attention path reads a released block (0 * NaN would
    poison its row)."""
    model = windowed_models[name]
    llm = LLM(
        model=str(model), attention_backend=backend, max_num_seqs=4, max_model_len=256,
        kv_cache_memory_bytes=8 << 20, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16,
        enable_chunked_prefill=True,
    )
    core = llm.llm_engine.engine_core.engine_core
    kv = core.scheduler.kv_cache_manager
    runner = core.executor.runner
    assert runner.attn_backend.name == backend
    free_blocks = kv.block_pool.free_blocks
    most_released: list[int] = [0]

    def poisoning(blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        free_blocks(blocks)
        freed = torch.tensor([b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null], dtype=torch.long)
        for key_cache, value_cache in runner.kv_caches:  # blocks lead both layouts
            key_cache[freed] = float("nan")
            value_cache[freed] = float("nan")
        most_released[0] = max(most_released[0], *kv.num_released_blocks.values(), 0)

    monkeypatch.setattr(kv.block_pool, "free_blocks", poisoning)
    prompts = _prompts(4, (5, 13, 40, 27))
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    # The 40-token prompt's last step computes position 38 + num_new, whose window starts 7 before.
    assert most_released[0] == (38 + num_new - WINDOW + 1) // 4
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt)[0][:num_new], (name, len(prompt))


def test_one_long_request_holds_a_window_of_blocks(tmp_path: Path) -> None:
    """bench/window_blocks.py at 1,536 tokens, window 64, blocks of 16: the
    request's blocks at each decode step are exactly those its next query
    can read, ceil((64 - 1) / 16) + 1 = 5 at most, against all 96 of them
    without the window (same weights)."""
    bench = load_bench_script("window_blocks.py")
    window, bs, num_tokens, new_tokens = 64, 16, 1536, 24
    windowed_dir, full_dir = bench.build_models(tmp_path, window, num_tokens)
    windowed = bench.measure(windowed_dir, num_tokens, new_tokens, bs, max_num_batched_tokens=512)
    full = bench.measure(full_dir, num_tokens, new_tokens, bs, max_num_batched_tokens=512)
    prompt_len = num_tokens - new_tokens
    # Steps: prefill chunks of 512 (the last sampling the first token), then one per later token.
    starts = [*range(0, prompt_len, 512), *range(prompt_len, num_tokens - 1)]
    ends = [min(c + 512, prompt_len) for c in starts[:3]] + [c + 1 for c in starts[3:]]
    assert windowed.per_step == [-(-end // bs) - max(c - window + 1, 0) // bs for c, end in zip(starts, ends)]
    assert full.per_step == [-(-end // bs) for end in ends]
    assert windowed.last == bench.window_bound(window, bs) == 5
    assert max(windowed.per_step[3:]) == 5
    assert full.last == num_tokens // bs == 96


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_speculation_over_released_blocks(windowed_models: dict[str, Path], async_scheduling: bool) -> None:
    """n-gram drafts verified and rejected while blocks behind the window
    are released (blocks of 4): a rejection takes computed tokens back to
    the step's start plus one at least, so no block it released is read
    again, and the tokens match transformers."""
    model = windowed_models["mistral"]
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] * 4 for n in (6, 11)] + _prompts(6, (30,))
    llm = LLM(
        model=str(model), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20, block_size=4,
        max_num_batched_tokens=32, async_scheduling=async_scheduling,
        # Look-ups from one token: a random model repeats itself now and then, mostly not.
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1},
    )
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.kv_cache_manager.sliding_window == WINDOW
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        spec = llm.llm_engine.engine_core.make_stats().spec_decoding_stats
    finally:
        llm.shutdown()
    assert spec is not None and spec.num_draft_tokens > spec.num_accepted_tokens  # drafts were rejected
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt)[0], len(prompt)


def test_a_draft_model_keeps_every_block(windowed_models: dict[str, Path]) -> None:
    """A draft model shares the target's block table and catches up from a
    request's start, so nothing is released under it (here the target is
    its own draft: every draft is accepted)."""
    model = windowed_models["mistral"]
    prompts = _prompts(7, (13, 40))
    llm = LLM(
        model=str(model), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20,
        speculative_config={"model": str(model), "num_speculative_tokens": 3},
    )
    assert llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.sliding_window is None
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, prompt)[0], len(prompt)
