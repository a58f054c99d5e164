"""Speculative decoding in one process: greedy tokens equal transformers'
with each method on, under chunked prefill, prefix caching, preemption and
async scheduling, with drafts actually accepted (read from the scheduler's
counters, so the tests cannot pass with speculation silently off); stops,
max_tokens and logprobs inside an accepted run; structured outputs verified
under their grammar; requests that cannot speculate; the config's
validation and the metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from rayvllm import LLM, SamplingParams, StructuredOutputsParams
from rayvllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from rayvllm.config.engine_args import EngineArgs
from rayvllm.core.request import Request
from rayvllm.core.sched.scheduler import Scheduler
from rayvllm.entrypoints.cli import build_parser, engine_args_from
from rayvllm.frontend.metrics import EngineMetrics
from rayvllm.kernels import cpu_attention
from rayvllm.messages.block_hash import hash_block_tokens
from rayvllm.messages.engine_types import (
    ModelRunnerOutput,
    SchedulerStats,
    SpecDecodeOutput,
    SpecDecodingStats,
    PrefixCacheStats,
)
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.request import EngineCoreRequest, FinishReason
from rayvllm.spec_decode.eligibility import can_speculate
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

from hf_oracle import NUM_NEW, hf_greedy

# 17 blocks of 16 tokens for sequences of up to ~130 tokens: the scheduler
# must preempt; a 32-token budget chunks every prompt and truncates drafts.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks_override=17)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def repetitive_prompts() -> list[list[int]]:
    """Code-edit-like prompts that repeat themselves (n-gram drafts find
    matches), two sharing a 48-token prefix (prefix-cache hits), and one
    plain random prompt."""
    rng = random.Random(11)
    prompts = []
    for length in (9, 14, 21):
        unit = [rng.randrange(5, 4000) for _ in range(length)]
        prompts.append(unit * 4)
    shared = [rng.randrange(5, 4000) for _ in range(48)]
    prompts += [shared + [rng.randrange(5, 4000) for _ in range(k)] for k in (5, 17)]
    prompts.append([rng.randrange(5, 4000) for _ in range(37)])
    return prompts


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _run(model: Path, prompts: list[list[int]], **kwargs: object) -> tuple[list[list[int]], SchedulerStats]:
    llm = LLM(str(model), **{**ENGINE, **kwargs})
    try:
        got = _generate(llm, prompts)
        return got, llm.llm_engine.engine_core.make_stats()
    finally:
        llm.shutdown()


def _assert_speculated(stats: SchedulerStats) -> None:
    spec = stats.spec_decoding_stats
    assert spec is not None and spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    assert sum(spec.num_accepted_tokens_per_pos) == spec.num_accepted_tokens
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_stats.hits > 0


@pytest.mark.parametrize(
    "async_scheduling,c_decode", [(False, True), (True, True), (False, False)], ids=["sync", "async", "torch-decode"]
)
def test_ngram_greedy_equals_transformers(
    tiny_model_dir: Path, async_scheduling: bool, c_decode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts are verified as decode rows: by the C kernel, or (without it)
    by the torch reference's gathered index and mask."""
    if not c_decode:
        monkeypatch.setattr(cpu_attention, "supports", lambda *_: False)
    prompts = repetitive_prompts()
    got, stats = _run(tiny_model_dir, prompts, speculative_config=NGRAM, async_scheduling=async_scheduling)
    _assert_speculated(stats)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(tiny_model_dir, prompt)[0]


def test_draft_model_greedy_equals_transformers(draft_pair: tuple[Path, Path]) -> None:
    target, draft = draft_pair
    prompts = repetitive_prompts()
    got, stats = _run(target, prompts, speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    _assert_speculated(stats)
    spec = stats.spec_decoding_stats
    assert spec is not None and spec.num_accepted_tokens < spec.num_draft_tokens  # some rejected too
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(target, prompt)[0]


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_windowed_families_speculate_exactly(arch: str, tmp_path: Path) -> None:
    """Drafts verified through sliding windows (and Gemma 2's capped
    logits): a Mistral with a draft cut from it, a Gemma 2 with n-gram
    drafts; the tokens stay transformers'."""
    from rayvllm.models.truncated_draft import build_truncated_draft
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    extra: dict[str, object] = {"sliding_window": 8}
    if arch == "gemma2":
        extra.update(attn_logit_softcapping=1.0, query_pre_attn_scalar=24)
    spec = RandomModelSpec(arch=arch, num_hidden_layers=3, head_dim=32, norm_weight_std=0.2, seed=33, extra=extra)
    target = build_random_model(tmp_path / arch, spec)
    speculative = NGRAM if arch == "gemma2" else {
        "model": str(build_truncated_draft(target, tmp_path / "draft", 2)), "num_speculative_tokens": 3,
    }
    prompts = repetitive_prompts()
    got, stats = _run(target, prompts, speculative_config=speculative)
    _assert_speculated(stats)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(target, prompt)[0]


def test_stops_max_tokens_and_logprobs_inside_accepted_runs(draft_pair: tuple[Path, Path]) -> None:
    """A stop id, EOS or max_tokens that lands inside a run of accepted
    drafts ends the request right there, as without speculation; logprobs
    of accepted tokens equal the ordinary ones."""
    target, draft = draft_pair
    prompts = repetitive_prompts()[:3]
    plain = LLM(str(target), **ENGINE)
    spec = LLM(str(target), **ENGINE, speculative_config={"model": str(draft), "num_speculative_tokens": 4})
    try:
        reference = _generate(plain, prompts)
        tokenizer = plain.get_tokenizer()
        for prompt, ref in zip(prompts, reference):
            # The text token 9 adds: a stop string that ends there (or before).
            stop_text = tokenizer.decode(ref[:10])[len(tokenizer.decode(ref[:9])) :][-3:]
            for params in (
                SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop_token_ids=[ref[9]]),
                SamplingParams(temperature=0.0, max_tokens=NUM_NEW, stop=[stop_text], logprobs=1, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=NUM_NEW, logprobs=3, ignore_eos=True),
            ):
                want = plain.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
                got = spec.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
                assert got.token_ids == want.token_ids and got.text == want.text
                assert got.finish_reason == want.finish_reason and got.stop_reason == want.stop_reason
                assert len(got.logprobs or ()) == (len(got.token_ids) if params.logprobs else 0)
                if params.logprobs:
                    assert got.logprobs is not None and want.logprobs is not None
                    for mine, theirs in zip(got.logprobs, want.logprobs):
                        assert mine.keys() == theirs.keys()
                        for token, lp in mine.items():
                            assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
                            assert lp.rank == theirs[token].rank
        stats = spec.llm_engine.engine_core.make_stats().spec_decoding_stats
        assert stats is not None and stats.num_accepted_tokens > 0
    finally:
        plain.shutdown()
        spec.shutdown()


def test_requests_that_cannot_speculate_decode_as_before(tiny_model_dir: Path) -> None:
    """Penalties score each position by the tokens before it: such a
    request gets no drafts and decodes as without speculation."""
    prompts = repetitive_prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)
    plain = LLM(str(tiny_model_dir), **ENGINE)
    spec = LLM(str(tiny_model_dir), **ENGINE, speculative_config=NGRAM)
    try:
        assert _generate(spec, prompts, params) == _generate(plain, prompts, params)
        stats = spec.llm_engine.engine_core.make_stats().spec_decoding_stats
        assert stats is not None and stats.num_drafts == 0
    finally:
        plain.shutdown()
        spec.shutdown()


# A grammar whose greedy outputs repeat themselves (so n-gram drafts match).
COLOURS = {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 24}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_structured_outputs_speculate_under_their_grammar(tiny_model_dir: Path, async_scheduling: bool) -> None:
    """A constrained request speculates: each draft position is verified
    under the grammar advanced over the drafts before it, so greedy tokens
    equal decoding without speculation, drafts are accepted, and sampled
    outputs (seeded, temperature 1) still validate against the schema."""
    prompts = repetitive_prompts()[:4]
    so = StructuredOutputsParams(json=COLOURS)
    greedy = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so)
    plain = LLM(str(tiny_model_dir), **ENGINE, async_scheduling=async_scheduling)
    spec = LLM(str(tiny_model_dir), **ENGINE, speculative_config=NGRAM, async_scheduling=async_scheduling)
    try:
        want = _generate(plain, prompts, greedy)
        assert _generate(spec, prompts, greedy) == want
        stats = spec.llm_engine.engine_core.make_stats().spec_decoding_stats
        assert stats is not None and stats.num_accepted_tokens > 0
        for seed in range(4):
            sampled = SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_outputs=so)
            for out in spec.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False):
                if out.outputs[0].finish_reason == "stop":
                    jsonschema.validate(json.loads(out.outputs[0].text), COLOURS)
    finally:
        plain.shutdown()
        spec.shutdown()


# ---- the scheduler's side, with a stand-in worker -----------------------------------


def _scheduler(k: int = 3, budget: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128),
        CacheConfig(block_size=4, num_blocks=64),
        speculative_config=SpeculativeConfig(num_speculative_tokens=k, method="ngram"),
        can_speculate=can_speculate,
    )


def _decoding(sched: Scheduler, max_tokens: int = 20, stop: list[int] | None = None) -> Request:
    """A request whose prompt ran and sampled token 50, with drafts [51, 52, 53]."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=True)
    request = Request(EngineCoreRequest("r", [5, 6, 7, 8, 9, 10], params, eos_token_id=2))
    sched.add_request(request)
    sampled = ModelRunnerOutput(
        ["r"], [50], None, {}, spec_decode=SpecDecodeOutput(draft_token_ids={"r": [51, 52, 53]})
    )
    while not request.output_token_ids:  # prompt chunks, then the first token
        so = sched.schedule()
        done = request.num_computed_tokens >= request.num_tokens
        sched.update_from_output(so, sampled if done else ModelRunnerOutput([], [], None, {}))
    return request


def test_scheduler_budgets_drafts_and_takes_back_rejected_ones() -> None:
    sched = _scheduler()
    request = _decoding(sched)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 4}
    assert so.scheduled_spec_decode_tokens == {"r": [51, 52, 53]}
    assert request.num_computed_tokens == 10
    # One draft accepted, then the target's own token 60.
    outs = sched.update_from_output(
        so, ModelRunnerOutput([], [], None, {}, spec_decode=SpecDecodeOutput(token_ids={"r": [51, 60]}))
    )
    assert outs[0].new_token_ids == [51, 60]
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    stats = sched.make_stats().spec_decoding_stats
    assert stats == SpecDecodingStats(3, 1, 3, 1, [1, 0, 0])


def test_prefix_cache_hashes_only_accepted_tokens() -> None:
    """Drafts fill block 1 (positions 4..7) before they are verified; it is
    hashed only once its tokens are known, with the accepted ones."""
    sched = _scheduler()
    request = _decoding(sched)  # 6 prompt tokens + 50: positions 0..6
    kv = sched.kv_cache_manager
    so = sched.schedule()  # 50 at position 6, drafts 51, 52, 53 at 7..9
    assert kv.num_cached_blocks["r"] == 1
    sched.update_from_output(
        so, ModelRunnerOutput([], [], None, {}, spec_decode=SpecDecodeOutput(token_ids={"r": [60]}))
    )
    sched.schedule()
    assert kv.num_cached_blocks["r"] == 2
    block_1 = kv.req_to_blocks["r"][1]
    assert request.all_token_ids[4:8] == [9, 10, 50, 60]
    assert block_1.block_hash == hash_block_tokens(kv.req_to_block_hashes["r"][0], [9, 10, 50, 60], None)


def test_scheduler_trims_drafts_to_budget_and_max_tokens() -> None:
    sched = _scheduler(budget=3)
    _decoding(sched)
    assert sched.schedule().scheduled_spec_decode_tokens == {"r": [51, 52]}
    sched = _scheduler()
    _decoding(sched, max_tokens=3)
    assert sched.schedule().scheduled_spec_decode_tokens == {"r": [51]}


@pytest.mark.parametrize(
    "stop,max_tokens,kept,reason", [([52], 20, [51, 52], FinishReason.STOP), (None, 3, [51, 52], FinishReason.LENGTH)]
)
def test_scheduler_ends_a_request_inside_an_accepted_run(
    stop: list[int] | None, max_tokens: int, kept: list[int], reason: FinishReason
) -> None:
    sched = _scheduler()
    _decoding(sched, max_tokens=max_tokens, stop=stop)
    so = sched.schedule()
    outs = sched.update_from_output(
        so, ModelRunnerOutput([], [], None, {}, spec_decode=SpecDecodeOutput(token_ids={"r": [51, 52, 53, 54]}))
    )
    assert outs[0].new_token_ids == kept
    assert outs[0].finish_reason == reason
    assert not sched.has_unfinished_requests()


# ---- configuration and metrics ------------------------------------------------------


@pytest.mark.parametrize(
    "value,param",
    [
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model"),
        ({"model": "/nonexistent", "num_speculative_tokens": 2}, "speculative_config.model"),
        ("{not json", "speculative_config"),
        ([1, 2], "speculative_config"),
    ],
)
def test_bad_speculative_config_names_the_field(tiny_model_dir: Path, value: object, param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        EngineArgs.from_dict({"model": str(tiny_model_dir), "speculative_config": value}).create_engine_config()
    # A value of the wrong type is pydantic's to reject: it names each type tried.
    assert err.value.param == param or err.value.param.startswith(param + ".")


def test_draft_model_must_share_the_vocabulary(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_random_model(tmp_path / "other", RandomModelSpec(vocab_size=2048, num_hidden_layers=1))
    with pytest.raises(InvalidParameterError, match="vocab_size 2048") as err:
        EngineArgs(
            model=str(tiny_model_dir), speculative_config={"model": str(other), "num_speculative_tokens": 2}
        ).create_engine_config()
    assert err.value.param == "speculative_config.model"


def test_speculative_config_from_the_command_line(tiny_model_dir: Path) -> None:
    ns = build_parser().parse_args(
        ["generate", "x", "--model", str(tiny_model_dir), "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}']
    )
    spec = engine_args_from(ns).create_engine_config().speculative_config
    assert spec == SpeculativeConfig(num_speculative_tokens=3, method="ngram", prompt_lookup_max=4, prompt_lookup_min=4)


def test_spec_decode_metrics_count_increments() -> None:
    metrics = EngineMetrics("m", num_speculative_tokens=2)

    def stats(spec: SpecDecodingStats) -> SchedulerStats:
        return SchedulerStats(0, 0, 0.0, PrefixCacheStats(), 0, spec_decoding_stats=spec)

    metrics.record_scheduler_stats(stats(SpecDecodingStats(2, 3, 6, 4, [3, 1])))
    metrics.record_scheduler_stats(stats(SpecDecodingStats(2, 5, 10, 5, [4, 1])))
    text = metrics.render()[0].decode()
    assert 'rayvllm:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'rayvllm:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'rayvllm:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'rayvllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0' in text
    assert 'rayvllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' in text
    assert "spec_decode" not in EngineMetrics("m").render()[0].decode()
