"""The offline API end to end: LLM.generate / chat, per-prompt params, sampling
features through the whole engine, errors, and the CLI on the demo model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayvllm import LLM, SamplingParams
from rayvllm.messages.errors import InvalidParameterError, PromptTooLongError


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=64 << 20)


def test_outputs_in_input_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = ["Hello world", "the model is fast", "a", "ray serve cache block"]
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (3, 9, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1, 5]
    tok = llm.get_tokenizer()
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
        assert o.finished and o.metrics is not None
        assert o.metrics.arrival_time <= o.metrics.first_token_time <= o.metrics.finished_time


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["the city by the river"], seeded, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(
        ["noise one", "the city by the river", "noise two two"], [others, seeded, others], use_tqdm=False
    )[1]
    assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    greedy = llm.generate("hello ray", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(
        "hello ray", SamplingParams(temperature=0.9, top_k=1, max_tokens=10, ignore_eos=True, seed=1), use_tqdm=False
    )
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_n_samples_stop_tokens_and_min_tokens(llm: LLM) -> None:
    out = llm.generate("the", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate("the", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    first = greedy.outputs[0].token_ids
    stop_at = first[2]
    stopped = llm.generate("the", SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    k = first.index(stop_at)
    assert stopped.outputs[0].token_ids == first[: k + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at
    held = llm.generate(
        "the", SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at], min_tokens=k + 2), use_tqdm=False
    )[0]
    assert stop_at not in held.outputs[0].token_ids[: k + 2]


def test_stop_string_cuts_text(llm: LLM) -> None:
    base = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    stop = text[3:6]
    assert stop
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_prompt_logprobs_match_transformers(llm: LLM, tiny_model_dir: Path) -> None:
    prompt = [5, 77, 912, 40, 3000, 18, 64, 2048, 9, 11]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert len(entry) <= 3


def test_chat_uses_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4


def test_errors_are_clear_and_leave_engine_usable(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError):
        llm.generate({"prompt_token_ids": [7] * 600}, use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidParameterError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="unknown_knob"):
        LLM(model="x", unknown_knob=1)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_priority_scheduling_accepts_priorities(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2, ignore_eos=True), priority=[2, 0, 1], use_tqdm=False)
    order = sorted(outs, key=lambda o: o.metrics.first_token_time)
    assert [o.prompt for o in order] == ["b", "c", "a"]


def test_cli_generate_on_demo_model(tmp_path: Path) -> None:
    env = dict(os.environ, RAYVLLM_CACHE_DIR=str(tmp_path / "cache"))
    result = subprocess.run(
        [sys.executable, "-m", "rayvllm.entrypoints.cli", "generate", "Hello", "--max-tokens", "5", "--json"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert '"prompt": "Hello"' in result.stdout and '"finish_reason": "length"' in result.stdout
    from rayvllm.utils.demo import DEMO_VERSION

    assert (tmp_path / "cache" / f"demo-llama-v{DEMO_VERSION}" / "config.json").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logprobs_close_to_float32_reference(tiny_model_dir: Path, dtype: str) -> None:
    """Half types run through the torch attention path on CPU; their logprobs
    of the float32 greedy tokens stay close to transformers in float32."""
    prompt = [5, 77, 912, 40, 3000, 18]
    llm = LLM(model=str(tiny_model_dir), dtype=dtype, max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.engine_core.engine_core.executor.runner
    assert runner.kv_caches[0][0].dtype == getattr(torch, dtype) and not runner.use_c_decode
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[0, len(prompt):].tolist()
    ref_lp = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), dim=-1)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, temperature=0),
                       use_tqdm=False)[0]
    # Compare where the half-precision run stayed on the float32 path.
    for step, (tok, ref_tok) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
        assert abs(out.outputs[0].logprobs[step][tok].logprob - ref_lp[step, tok].item()) < 0.05
        if tok != ref_tok:
            break


def test_async_scheduling_defaults_by_executor(tiny_model_dir: Path) -> None:
    """On where a step runs in a worker actor while the loop schedules the
    next (the Ray path with data parallelism over single-rank groups); off
    where the loop's own thread runs the model (in-process, or the
    SchedulerActor hosting the one worker); with tensor parallelism on
    request; asking for it with pipeline stages is an error naming the field."""
    from rayvllm.config.engine_args import EngineArgs

    def resolved(**kw: object) -> bool:
        return EngineArgs(model=str(tiny_model_dir), **kw).create_engine_config().scheduler_config.async_scheduling

    assert resolved() is False
    assert resolved(distributed_executor_backend="ray") is False
    assert resolved(data_parallel_size=2) is True
    assert resolved(tensor_parallel_size=2) is False
    assert resolved(tensor_parallel_size=2, async_scheduling=True) is True
    assert resolved(async_scheduling=True) is True
    assert resolved(distributed_executor_backend="ray", async_scheduling=True) is True
    with pytest.raises(InvalidParameterError, match="async_scheduling"):
        resolved(pipeline_parallel_size=2, async_scheduling=True)
