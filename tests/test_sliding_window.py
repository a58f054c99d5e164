"""Sliding-window attention, exact against transformers (float32, CPU):
Mistral and Phi-3 with a window on every layer, Qwen2 with
`use_sliding_window` on the layers from `max_window_layers` on. The window (8 keys) is far shorter
than the prompts plus the 24 tokens generated, so every prompt runs past
it; through the whole engine, with chunked prefill and prefix-cache hits
(before this, a windowed Mistral was served with full attention: 0 of 4
prompts matched transformers). On float32 CPU the decodes (and on AVX-512
the prefills) run in the C attention kernels, which start at the window."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rayvllm import LLM, SamplingParams
from rayvllm.kernels import cpu_attention
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

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
