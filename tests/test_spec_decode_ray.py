"""Speculative decoding on the Ray path: the SchedulerActor schedules drafts
(with async scheduling asked for) and its runner verifies them, and
the counters reach the server's metrics; under tensor parallelism (gloo)
the sampling rank runs the draft model while every rank verifies. Greedy
tokens equal transformers' throughout."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rayvllm import LLM  # noqa: E402
from rayvllm.actors.factory import async_llm_from_engine_args  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402

from hf_oracle import hf_greedy  # noqa: E402
from test_spec_decode import ENGINE, GREEDY, NGRAM, repetitive_prompts  # noqa: E402


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def test_async_llm_on_ray_with_ngram(ray_local: None, tiny_model_dir: Path) -> None:
    prompts = repetitive_prompts()

    async def main() -> tuple[list[list[int]], str, bool]:
        args = EngineArgs(
            model=str(tiny_model_dir), distributed_executor_backend="ray", async_scheduling=True,
            speculative_config=NGRAM, **ENGINE,
        )
        engine = async_llm_from_engine_args(args)
        try:
            async def collect(i: int, prompt: list[int]) -> list[int]:
                tokens: list[int] = []
                async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, f"r{i}"):
                    tokens += out.outputs[0].token_ids  # deltas
                return tokens

            got = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))
            await engine.refresh_stats()  # what a /metrics scrape does
            return list(got), engine.metrics.render()[0].decode(), engine.config.scheduler_config.async_scheduling
        finally:
            engine.shutdown()

    got, metrics, async_scheduling = asyncio.run(main())
    assert async_scheduling
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(tiny_model_dir, prompt)[0]
    assert _metric(metrics, "rayvllm:spec_decode_num_draft_tokens_total") > 0
    accepted = _metric(metrics, "rayvllm:spec_decode_num_accepted_tokens_total")
    assert accepted > 0
    assert _metric(metrics, "rayvllm:spec_decode_num_accepted_tokens_per_pos_total") > 0  # position 0


def test_tensor_parallel_with_a_draft_model(ray_local: None, draft_pair: tuple[Path, Path]) -> None:
    target, draft = draft_pair
    prompts = repetitive_prompts()
    llm = LLM(
        str(target), tensor_parallel_size=2, **ENGINE,
        speculative_config={"model": str(draft), "num_speculative_tokens": 3},
    )
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.engine_core.make_stats()
    finally:
        llm.shutdown()
    assert stats.spec_decoding_stats is not None and stats.spec_decoding_stats.num_accepted_tokens > 0
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(target, prompt)[0]
