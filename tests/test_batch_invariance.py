"""Batch-invariant mode (`deterministic=True`): a request's tokens, sampled
logprobs and prompt logprobs are bitwise the same alone, beside a dozen
other requests, with its prompt chunked 16 tokens at a time, after being
preempted and recomputed, and with its prefix served from the cache; greedy
tokens still match transformers. What the mode cannot cover is refused."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.kernels import gemm_select
from rayvllm.messages.errors import InvalidParameterError
from hf_oracle import NUM_NEW, hf_greedy

RNG = random.Random(11)
TARGET = [RNG.randrange(5, 4000) for _ in range(70)]
OTHERS = [[RNG.randrange(5, 4000) for _ in range(RNG.randint(5, 120))] for _ in range(12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)
KINDS = {"greedy": GREEDY, "seeded": SEEDED}


@dataclass
class Result:
    """The target request's outputs; equal results have the same bits."""

    tokens: list[int]
    logprobs: list[Any]
    prompt_logprobs: list[Any]
    cached_tokens: int = field(compare=False)


def _lp(rows: Any) -> list[Any]:
    """Logprob rows as comparable values (token id -> exact float)."""
    return [None if r is None else sorted((t, lp.logprob) for t, lp in r.items()) for r in rows or []]


def _run(llm: LLM, params: SamplingParams, others: list[list[int]]) -> Result:
    """The target's result when it runs first in a batch with `others`."""
    prompts = [{"prompt_token_ids": p} for p in [TARGET, *others]]
    out = llm.generate(prompts, [params] + [GREEDY] * len(others), use_tqdm=False)[0]
    completion = out.outputs[0]
    return Result(completion.token_ids, _lp(completion.logprobs), _lp(out.prompt_logprobs), out.num_cached_tokens or 0)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path) -> dict[str, dict[str, Result]]:
    """name -> {"greedy", "seeded"} results under each disturbance."""
    results: dict[str, dict[str, Result]] = {}
    base = dict(dtype="float32", max_model_len=256, deterministic=True)
    llm = LLM(str(tiny_model_dir), **base)
    try:
        assert all(m.gemm.plan == gemm_select.BATCH_INVARIANT_PLAN for m in _gemm_modules(llm))
        for name, others in (("alone", []), ("beside 12 others", OTHERS), ("prefix cached", OTHERS[:3])):
            results[name] = {kind: _run(llm, params, others) for kind, params in KINDS.items()}
        assert results["prefix cached"]["seeded"].cached_tokens > 0  # (prompt logprobs recompute the prompt)
    finally:
        llm.shutdown()
    # 16-token chunks and too few blocks for everything: prompts are split
    # and requests preempted (their KV recomputed in other batches).
    llm = LLM(str(tiny_model_dir), **base, max_num_batched_tokens=16, num_gpu_blocks_override=18,
              enable_prefix_caching=False)
    try:
        results["chunked and preempted"] = {kind: _run(llm, params, OTHERS) for kind, params in KINDS.items()}
        assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0
    finally:
        llm.shutdown()
    return results


def _gemm_modules(llm: LLM) -> list[Any]:
    runner = llm.llm_engine.engine_core.engine_core.executor.runner
    return [m for m in runner.model.modules() if getattr(m, "gemm", None) is not None]


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("name", ["beside 12 others", "prefix cached", "chunked and preempted"])
def test_a_request_is_bitwise_the_same_however_it_is_batched(
    runs: dict[str, dict[str, Result]], name: str, kind: str
) -> None:
    got, alone = runs[name][kind], runs["alone"][kind]
    assert got.tokens == alone.tokens
    assert got.logprobs == alone.logprobs  # exact floats, not a tolerance
    assert got.prompt_logprobs == alone.prompt_logprobs
    assert len(got.logprobs) == NUM_NEW and (kind == "seeded" or len(got.prompt_logprobs) == len(TARGET))


def test_two_tensor_parallel_ranks_on_ray(ray_local: None, tiny_model_dir: Path) -> None:
    """The row-parallel layers' partial sums of two ranks add to the same
    bits in either order; alone and beside others, the same result."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, deterministic=True, tensor_parallel_size=2)
    try:
        alone, beside = [_run(llm, SEEDED, others) for others in ([], OTHERS)]
    finally:
        llm.shutdown()
    assert beside == alone and len(alone.tokens) == NUM_NEW


def test_greedy_tokens_still_match_transformers(runs: dict[str, dict[str, Result]], tiny_model_dir: Path) -> None:
    assert runs["alone"]["greedy"].tokens == hf_greedy(tiny_model_dir, TARGET)[0]


def test_the_c_gemm_gives_each_row_the_same_bits_whatever_rows_are_beside_it() -> None:
    from rayvllm.kernels import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the C GEMM kernel did not build here")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=gen)
    x = torch.randn(70, 200, generator=gen)
    gemm = gemm_select.PlannedGemm(weight, gemm_select.BATCH_INVARIANT_PLAN)
    alone = torch.cat([gemm(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 8, 17, 64, 70):
        assert torch.equal(gemm(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize(
    "extra,missing",
    [
        (dict(dtype="bfloat16"), "dtype float32"),
        (dict(enable_lora=True), "no LoRA"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "no speculative decoding"),
        (dict(attention_backend="triton"), "attention_backend auto or torch"),
        (dict(tensor_parallel_size=4), "tensor_parallel_size <= 2"),
    ],
)
def test_what_the_mode_cannot_cover_is_refused(tiny_model_dir: Path, extra: dict, missing: str) -> None:
    from rayvllm.config.engine_args import EngineArgs

    args = EngineArgs(model=str(tiny_model_dir), deterministic=True, **extra)
    with pytest.raises(InvalidParameterError) as info:
        args.create_engine_config()
    assert info.value.param == "deterministic" and missing in str(info.value)
