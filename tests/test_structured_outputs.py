"""Structured outputs through the whole engine, on a random-weight model
whose unconstrained output is never valid JSON: only the grammar mask can
make it so. Exactness: greedy decoding under a mask equals transformers'
logits masked by an independent xgrammar matcher, step by step."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
from pathlib import Path

import jsonschema
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from rayvllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from rayvllm.actors.factory import async_llm_from_engine_args  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.engine.async_llm import AsyncLLM  # noqa: E402
from rayvllm.messages.errors import InvalidParameterError  # noqa: E402
from rayvllm.structured_output.bitmask import apply_token_bitmask_, apply_token_bitmask_torch_  # noqa: E402
from hf_oracle import hf_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["city", "size", "ok"],
}
REGEX = r"(red|green|blue)-[0-9]{2,4}"
CHOICES = ["yes", "no", "maybe later"]
SEEDS = range(12)
ENGINE = dict(max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=64 << 20)


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] bool from one bitmask row: bit t % 32 of word t // 32."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def _so(**kwargs: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), **ENGINE)


def _sampled(llm: LLM, so: StructuredOutputsParams, max_tokens: int = 120) -> list[tuple[str, str | None]]:
    """(text, finish_reason) per seed, all seeds in one batch beside an
    unconstrained request (so the mask covers some rows of a batch only)."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=so) for s in SEEDS]
    params.append(SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True))
    outs = llm.generate(["Answer in JSON: where"] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs[:-1]]


def test_json_schema_outputs_validate_for_every_seed(llm: LLM) -> None:
    # Compact: free whitespace lets a random model spend its tokens on it.
    texts = _sampled(llm, _so(json=SCHEMA, disable_any_whitespace=True))
    for text, finish in texts:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in texts}) > 1  # sampling, not one forced string
    unconstrained = llm.generate("Answer in JSON: where", SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(unconstrained[0].outputs[0].text)


def test_free_whitespace_json_and_json_object(llm: LLM) -> None:
    """vLLM's default allows any whitespace between JSON tokens, which a
    random model may spend max_tokens on: a cut output is allowed then."""
    texts = _sampled(llm, _so(json=json.dumps(SCHEMA)), max_tokens=200)
    for text, finish in texts:
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert finish == "length" and text.lstrip().startswith("{")
    assert any(finish == "stop" for _, finish in texts)
    for text, finish in _sampled(llm, _so(json_object=True), max_tokens=200):
        # Any object: a long one may be cut by max_tokens, which is allowed.
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert finish == "length" and text.lstrip().startswith("{")


def test_regex_choice_and_grammar(llm: LLM) -> None:
    for text, finish in _sampled(llm, _so(regex=REGEX)):
        assert finish == "stop" and re.fullmatch(REGEX, text), text
    texts = _sampled(llm, _so(choice=CHOICES))
    assert all(finish == "stop" and text in CHOICES for text, finish in texts)
    ebnf = 'root ::= ("ab" | "cd") [0-9] ("!" | "?")'
    for text, finish in _sampled(llm, _so(grammar=ebnf)):
        assert finish == "stop" and re.fullmatch(r"(ab|cd)[0-9][!?]", text), text


def test_greedy_with_mask_equals_masked_transformers(llm: LLM, tiny_model_dir: Path) -> None:
    """The exactness proof: an independent matcher masks transformers'
    logits each step (bits unpacked here, not by the engine's kernel),
    argmax picks; the engine must produce the same tokens."""
    prompt = "the city by the river"
    got = llm.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=_so(json=SCHEMA, disable_any_whitespace=True)),
        use_tqdm=False,
    )[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    model = hf_model(tiny_model_dir)
    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False), override_stop_tokens=[tokenizer.eos_token_id]
    )
    ids = tokenizer.encode(prompt)
    expected: list[int] = []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    with torch.no_grad():
        while len(expected) < 60 and not matcher.is_terminated():
            logits = model(torch.tensor([ids + expected])).logits[:, -1].float()
            matcher.fill_next_token_bitmask(bitmask)
            logits[0, ~_allowed(bitmask[0], vocab)] = float("-inf")
            token = int(logits.argmax(-1))
            assert matcher.accept_token(token)
            expected.append(token)
    assert got.token_ids == expected
    assert got.finish_reason == "stop" and expected[-1] == tokenizer.eos_token_id


def test_bitmask_rows_apply_only_where_constrained() -> None:
    logits = torch.randn(3, 100)
    bitmask = torch.zeros(3, 4, dtype=torch.int32)
    bitmask[2, 1] = 1 << 3  # row 2 allows token 35 only
    for apply in (apply_token_bitmask_, apply_token_bitmask_torch_):
        out = logits.clone()
        apply(out, bitmask, [2])
        assert torch.equal(out[:2], logits[:2])
        assert out[2, 35] == logits[2, 35] and (out[2] == float("-inf")).sum() == 99
    # The torch path (other devices) equals xgrammar's kernel (the CPU's).
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 32), dtype=torch.int32, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_torch_(ours, bitmask, [4, 0, 2])
    apply_token_bitmask_(theirs, bitmask, [4, 0, 2])
    assert torch.equal(ours, theirs)


def test_async_scheduling_and_preemption_keep_outputs(tiny_model_dir: Path, llm: LLM) -> None:
    """Async scheduling (the mask of step k+1 needs step k's token, which
    the scheduler has not seen when it schedules k+1) and preemption by
    recompute (the matcher is rebuilt over the emitted tokens) give the
    outputs of the plain engine."""
    so = _so(json=SCHEMA)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so) for s in SEEDS]
    prompts = [f"Answer in JSON {i}: where" for i in SEEDS]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # 20 blocks of 16 tokens hold two of these 128-token requests, not eight.
    for extra in ({"async_scheduling": True}, {"num_gpu_blocks_override": 20, "max_model_len": 256}):
        other = LLM(model=str(tiny_model_dir), **(ENGINE | extra))
        try:
            outs = other.generate(prompts, params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == expected
            if "num_gpu_blocks_override" in extra:
                assert other.llm_engine.engine_core.engine_core.scheduler.num_preemptions > 0
        finally:
            other.shutdown()


def test_resumed_request_continues_its_grammar(llm: LLM) -> None:
    """A request resumed on a new engine carries its emitted tokens; its
    matcher is advanced over them and the rest is what an undisturbed run
    produces (seeded: the generator is advanced too)."""
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=120, structured_outputs=_so(json=SCHEMA))
    full = llm.generate("Answer in JSON: where", params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(full) > 6
    engine = llm.llm_engine
    request = engine.processor.process("resumed", "Answer in JSON: where", params)
    client = engine.engine_core
    client.add_requests([dataclasses.replace(request, output_token_ids=full[:5])])
    rest: list[int] = []
    finished = False
    while not finished:
        for out in client.step():
            rest += out.new_token_ids
            finished = finished or out.finish_reason is not None
    assert full[:5] + rest == full


@pytest.mark.parametrize(
    ("so", "param"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"json": SCHEMA, "regex": "a"}, "structured_outputs"),
        ({}, "structured_outputs"),
    ],
)
def test_invalid_grammars_fail_at_admission(llm: LLM, so: dict, param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=_so(**so)), use_tqdm=False)
    assert info.value.param == param
    # The engine is untouched: the next request runs.
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_min_tokens_is_refused_with_a_grammar() -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(min_tokens=2, structured_outputs=_so(regex="a+"))
    assert info.value.param == "min_tokens"


def test_ignore_eos_still_ends_with_the_grammar(llm: LLM) -> None:
    out = llm.generate(
        "pick", SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=50, structured_outputs=_so(choice=CHOICES)),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop"


def _ray_case(llm: LLM) -> tuple[list[str], list[SamplingParams], list[list[int]]]:
    so = _so(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so) for s in range(4)]
    prompts = [f"Answer in JSON {i}: where" for i in range(4)]
    return prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_ray_path_with_async_scheduling_matches(ray_local: None, tiny_model_dir: Path, llm: LLM) -> None:
    """On the Ray path the SchedulerActor's runner holds the matchers, with
    async scheduling asked for; seeded constrained outputs are the
    in-process engine's."""
    prompts, params, expected = _ray_case(llm)
    remote = LLM(model=str(tiny_model_dir), distributed_executor_backend="ray", async_scheduling=True, **ENGINE)
    try:
        assert remote.llm_engine.config.scheduler_config.async_scheduling
        outs = remote.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        remote.shutdown()


def test_killed_engine_resumes_constrained_streams(ray_local: None, tiny_model_dir: Path, llm: LLM) -> None:
    """The engine process is killed mid-generation: AsyncLLM starts a new
    one and resumes each request from prompt + streamed tokens; the new
    worker's matchers are rebuilt over those tokens, so every stream ends
    exactly as an undisturbed run (valid JSON included)."""
    prompts, params, expected = _ray_case(llm)

    async def main() -> tuple[list[list[int]], int, int]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            # The SchedulerActor runs the model itself at world size 1.
            actor = engine.engine_core.actor
            victim = await actor.__ray_call__.remote(lambda _self: os.getpid())
            tokens: list[list[int]] = [[] for _ in prompts]
            killed_at: list[int] = []

            async def consume(i: int) -> None:
                async for out in engine.generate(prompts[i], params[i], f"r{i}"):
                    tokens[i] += out.outputs[0].token_ids
                    # Outputs that arrive together come as one delta: at
                    # least 4 tokens, not exactly 4.
                    if i == 0 and len(tokens[0]) >= 4 and not killed_at:
                        killed_at.append(len(tokens[0]))
                        os.kill(victim, signal.SIGKILL)

            await asyncio.gather(*(consume(i) for i in range(len(prompts))))
            return tokens, engine.restarts.total, killed_at[0]
        finally:
            engine.shutdown()

    tokens, restarts, killed_at = asyncio.run(main())
    assert restarts == 1 and len(expected[0]) > killed_at
    assert tokens == expected


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", "", False)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer"}}}},
         ("json", '{"type": "integer"}', False)),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, ("regex", "a+", True)),
        ({"guided_json": '{"type": "boolean"}'}, ("json", '{"type": "boolean"}', False)),
        ({"guided_choice": ["x", "y"]}, ("choice", '["x", "y"]', False)),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"', False)),
    ],
)
def test_request_forms_give_one_grammar(body: dict, key: tuple | None) -> None:
    from rayvllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request

    for model, base in ((ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}), (CompletionRequest, {"prompt": "hi"})):
        params = parse_request(model, base | body).to_sampling_params()
        assert (params.structured_outputs.key if params.structured_outputs else None) == key
