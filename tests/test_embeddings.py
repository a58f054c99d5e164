"""Embeddings from the pooling runner equal transformers' final hidden
states (the last token's, or the mean over the prompt; L2-normalised and
not) within 1e-4 in float32, through `LLM.embed`: batched through the
scheduler with chunked prefill (and a preemption mid-prefill), with prefix-cache hits for
last-token pooling (mean pooling reads no cached prefix), in-process and on
the Ray path. Plus the knobs (`runner`, `task`, `pooler_config`) and the
errors of asking a model for what its runner does not do."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from rayvllm import LLM, EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, SamplingParams
from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.messages.errors import InvalidParameterError, PromptTooLongError
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

from hf_oracle import hf_embedding

SPECS = {
    "llama": RandomModelSpec(arch="llama", num_attention_heads=4, num_key_value_heads=2, seed=31),
    "qwen2": RandomModelSpec(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, seed=32),
    "qwen3": RandomModelSpec(
        arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, seed=33
    ),
    "olmo2": RandomModelSpec(arch="olmo2", num_attention_heads=4, num_key_value_heads=2, norm_weight_std=0.3, seed=34),
    # Windowed layers (8 keys: the long prompts run past them) and soft-capped attention.
    "gemma2": RandomModelSpec(arch="gemma2", num_hidden_layers=3, norm_weight_std=0.2, seed=35,
                              extra={"sliding_window": 8, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 24}),
}
# A 32-token budget chunks every long prompt over several steps.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks_override=17, max_num_seqs=8)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embed-models")
    return {name: build_random_model(root / name, spec) for name, spec in SPECS.items()}


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 90))] for _ in range(8)]
    # A one-token prompt (scheduled like a decode), and a repeat of the first.
    return prompts + [[7], list(prompts[0])]


def _check(model_dir: Path, outputs: list[EmbeddingRequestOutput], prompts: list[list[int]], pooling: str,
           normalize: bool) -> None:
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        assert out.finished and out.prompt_token_ids == prompt
        got = torch.tensor(out.outputs.embedding)
        want = hf_embedding(model_dir, prompt, pooling, normalize)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embed_matches_transformers(models: dict[str, Path], name: str, pooling: str) -> None:
    model_dir = models[name]
    prompts = _prompts()
    # Async scheduling for one pooling type: a pooling request must not get
    # a placeholder for a token it never samples.
    llm = LLM(str(model_dir), runner="pooling", pooler_config={"pooling_type": pooling},
              async_scheduling=pooling == "LAST", **ENGINE)
    try:
        core = llm.llm_engine.engine_core
        _check(model_dir, llm.embed(prompts, use_tqdm=False), prompts, pooling, normalize=True)
        core.make_stats()
        raw = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(normalize=False), use_tqdm=False)
        _check(model_dir, raw, prompts, pooling, normalize=False)
        stats = core.make_stats().prefix_cache_stats
        if pooling == "LAST":
            assert stats.hits > 0  # the second pass reused cached prefixes, and stayed exact
        else:
            assert stats.queries == 0  # mean pooling computes every position itself
    finally:
        llm.shutdown()


def test_preempted_mid_prefill_starts_over(models: dict[str, Path]) -> None:
    """A mean-pooled request preempted after its first chunk is recomputed
    from scratch: the worker's partial sum goes with its dropped state."""
    model_dir = models["llama"]
    prompt = _prompts()[0]
    assert len(prompt) > 2 * ENGINE["max_num_batched_tokens"]
    llm = LLM(str(model_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    try:
        # The core stepped by hand (its loop, on its thread, waits for
        # inputs that never come): preempted between two steps.
        engine = llm.llm_engine
        core = engine.engine_core.engine_core
        core.add_request(engine.processor.process("p", {"prompt_token_ids": prompt}, PoolingParams()))
        assert core.step() == []
        scheduler = core.scheduler
        [request] = scheduler.running
        assert 0 < request.num_computed_tokens < len(prompt)
        scheduler._preempt(request)
        outputs = []
        while core.has_unfinished_requests():
            outputs += core.step()
        [out] = outputs
        want = hf_embedding(model_dir, prompt, "MEAN", True)
        assert out.pooling_output is not None
        assert (torch.from_numpy(out.pooling_output) - want).abs().max().item() < TOL
        assert scheduler.num_preemptions == 1
    finally:
        llm.shutdown()


def test_text_prompts_and_lm_head_skipped(models: dict[str, Path]) -> None:
    """A text prompt is tokenized as for generation; the pooling model
    holds no LM head."""
    model_dir = models["llama"]
    llm = LLM(str(model_dir), task="embed", **ENGINE)
    try:
        model = llm.llm_engine.engine_core.engine_core.executor.runner.model
        assert model is not None and model.lm_head is None
        [out] = llm.embed("Hello, my name is", use_tqdm=False)
        ids = llm.get_tokenizer().encode("Hello, my name is")
        assert out.prompt_token_ids == ids
        want = hf_embedding(model_dir, ids, "LAST", True)
        assert (torch.tensor(out.outputs.embedding) - want).abs().max().item() < TOL
        [pooled] = llm.encode({"prompt": "Hello, my name is"}, use_tqdm=False)
        assert pooled.outputs.data.dtype == torch.float32
        assert (pooled.outputs.data - want).abs().max().item() < TOL
        # A pooled prompt may fill the context: nothing is generated after it.
        assert len(llm.embed([[9] * 256], use_tqdm=False)[0].outputs.embedding) == 128
        with pytest.raises(PromptTooLongError):
            llm.embed([[9] * 257], use_tqdm=False)
        with pytest.raises(InvalidParameterError) as e:
            llm.embed("hi", PoolingParams(dimensions=16), use_tqdm=False)
        assert e.value.param == "dimensions"
        with pytest.raises(InvalidParameterError) as e:
            llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert e.value.param == "model" and "does not generate" in str(e.value)
    finally:
        llm.shutdown()


def test_async_engine_encodes_concurrently(models: dict[str, Path]) -> None:
    """`AsyncLLM.encode`, several at once: each stream yields its one finished vector."""
    model_dir = models["qwen3"]
    prompts = _prompts()[:4]

    async def main() -> list[list[PoolingRequestOutput]]:
        engine = async_llm_from_engine_args(EngineArgs(model=str(model_dir), runner="pooling", **ENGINE))
        try:

            async def one(i: int) -> list[PoolingRequestOutput]:
                return [out async for out in engine.encode({"prompt_token_ids": prompts[i]}, PoolingParams(), f"r{i}")]

            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            engine.shutdown()

    for prompt, outs in zip(prompts, asyncio.run(main())):
        [out] = outs
        assert out.finished and out.prompt_token_ids == prompt
        assert (out.outputs.data - hf_embedding(model_dir, prompt, "LAST", True)).abs().max().item() < TOL


def test_a_bare_decoder_checkpoint_pools(models: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint without LM head (`Qwen2Model`, as embedding models ship,
    weights without the "model." prefix) runs the pooling runner by default
    and computes what its causal-LM twin's decoder computes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    causal = models["qwen2"]
    AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32).model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(causal).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen2Model"]
    prompts = _prompts()[:3]
    llm = LLM(str(tmp_path), **ENGINE)
    try:
        assert llm.llm_engine.config.model_config.is_pooling
        _check(causal, llm.embed(prompts, use_tqdm=False), prompts, "LAST", normalize=True)
    finally:
        llm.shutdown()
    with pytest.raises(InvalidParameterError) as e:
        EngineArgs(model=str(tmp_path), runner="generate").create_engine_config()
    assert e.value.param == "runner"


def test_a_generating_model_refuses_embed(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    try:
        with pytest.raises(InvalidParameterError) as e:
            llm.embed("hi", use_tqdm=False)
        assert e.value.param == "model" and "does not support embeddings" in str(e.value)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "args, param",
    [
        ({"runner": "generate", "task": "embed"}, "task"),
        ({"runner": "pooling", "task": "generate"}, "task"),
        ({"runner": "draft"}, "runner"),
        ({"task": "classify"}, "task"),
        ({"pooler_config": {"pooling_type": "MEAN"}}, "pooler_config"),
        ({"runner": "pooling", "pooler_config": {"pooling": "MEAN"}}, "pooler_config"),
        ({"runner": "pooling", "pooler_config": {"pooling_type": "CLS"}}, "pooler_config.pooling_type"),
        ({"runner": "pooling", "pooler_config": "{not json"}, "pooler_config"),
    ],
)
def test_bad_pooling_knobs_name_the_field(args: dict, param: str) -> None:
    engine_args = EngineArgs(**args)
    with pytest.raises(InvalidParameterError) as e:
        runner = engine_args.resolve_runner()
        engine_args.create_pooler_config(runner)
    assert e.value.param == param


def test_pooling_knobs_resolve_as_vllm() -> None:
    assert EngineArgs(task="embed").resolve_runner() == "pooling"
    assert EngineArgs(task="embedding").resolve_runner() == "pooling"
    assert EngineArgs().resolve_runner() == "generate"
    # The JSON text a command line gives, with the older override on top.
    args = EngineArgs(runner="pooling", pooler_config='{"pooling_type": "mean"}',
                      override_pooler_config={"normalize": False})
    config = args.create_pooler_config("pooling")
    assert config is not None and (config.pooling_type, config.normalize) == ("MEAN", False)
    default = EngineArgs(runner="pooling").create_pooler_config("pooling")
    assert default is not None and (default.pooling_type, default.normalize) == ("LAST", True)


def test_ray_path_tensor_parallel(ray_local: None, models: dict[str, Path]) -> None:
    """Two TP ranks on Ray: only the driver pools, the vectors are exact."""
    model_dir = models["qwen3"]
    prompts = _prompts()
    llm = LLM(str(model_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"},
              tensor_parallel_size=2, **ENGINE)
    try:
        _check(model_dir, llm.embed(prompts, use_tqdm=False), prompts, "MEAN", normalize=True)
    finally:
        llm.shutdown()
