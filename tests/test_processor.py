"""Processor: tokenization, chat templates, validation errors, n > 1 fan-out;
tokenizer loading and EOS resolution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rayvllm.config import ModelConfig
from rayvllm.frontend.processor import DEFAULT_MAX_LOGPROBS, Processor, child_request_id, fan_out
from rayvllm.messages.errors import InvalidParameterError, PromptTooLongError
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.utils.tokenizer import get_eos_token_ids, get_tokenizer, load_generation_config_eos_ids

MAX_MODEL_LEN = 64
VOCAB = 4096
EOS = 2


@pytest.fixture(scope="module")
def model_config(tiny_model_dir: Path) -> ModelConfig:
    return ModelConfig.from_path(str(tiny_model_dir), None, "auto", MAX_MODEL_LEN, 0, "cpu")


@pytest.fixture(scope="module")
def processor(model_config: ModelConfig, tiny_tokenizer: Any) -> Processor:
    return Processor(model_config, tiny_tokenizer)


def param_of(excinfo: pytest.ExceptionInfo[InvalidParameterError]) -> str:
    return excinfo.value.param


# ---- prompts -----------------------------------------------------------------------


def test_text_prompt_is_tokenized(processor: Processor, tiny_tokenizer: Any) -> None:
    req = processor.process("r", "hello world", SamplingParams(), arrival_time=5.0, priority=3)
    assert isinstance(req, EngineCoreRequest)
    assert req.request_id == "r"
    assert req.prompt_token_ids == tiny_tokenizer.encode("hello world")
    assert req.arrival_time == 5.0 and req.priority == 3
    assert req.eos_token_id == EOS


def test_prompt_dict_forms(processor: Processor, tiny_tokenizer: Any) -> None:
    ids = tiny_tokenizer.encode("the model")
    a = processor.process("a", {"prompt": "the model", "cache_salt": "s1"}, SamplingParams())
    b = processor.process("b", {"prompt_token_ids": ids}, SamplingParams())
    assert a.prompt_token_ids == ids and a.cache_salt == "s1"
    assert b.prompt_token_ids == ids and b.cache_salt is None
    assert Processor.prompt_text({"prompt_token_ids": ids}) is None
    assert Processor.prompt_text({"prompt": "x"}) == "x"
    assert Processor.prompt_text("y") == "y"


def test_arrival_time_defaults_to_now(processor: Processor) -> None:
    req = processor.process("r", "hello", SamplingParams())
    assert req.arrival_time > 0


@pytest.mark.parametrize(
    ("prompt", "param"),
    [
        ("", "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, "x"]}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"prompt_token_ids": [5, True]}, "prompt_token_ids"),
        ({"prompt": 5}, "prompt"),
        ({"text": "hi"}, "prompt"),
        ({"prompt": "hi", "bogus": 1}, "prompt"),
        ({"prompt": "hi", "cache_salt": 3}, "cache_salt"),
        (12, "prompt"),
        (None, "prompt"),
        ("ab\ud800c", "prompt"),  # a lone surrogate: JSON allows it, the tokenizer raises TypeError
    ],
)
def test_malformed_prompts_name_the_field(processor: Processor, prompt: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", prompt, SamplingParams())
    assert param_of(e) == param


@pytest.mark.parametrize("bad_id", [-1, VOCAB, VOCAB + 100])
def test_prompt_ids_outside_vocab(processor: Processor, bad_id: int) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", {"prompt_token_ids": [5, bad_id, 6]}, SamplingParams())
    assert param_of(e) == "prompt_token_ids"
    assert str(bad_id) in str(e.value)


def test_prompt_ids_at_vocab_edges_are_fine(processor: Processor) -> None:
    req = processor.process("r", {"prompt_token_ids": [0, VOCAB - 1]}, SamplingParams())
    assert req.prompt_token_ids == [0, VOCAB - 1]


def test_prompt_too_long(processor: Processor) -> None:
    # Exactly max_model_len leaves no room for an output token.
    with pytest.raises(PromptTooLongError) as e:
        processor.process("r", {"prompt_token_ids": [7] * MAX_MODEL_LEN}, SamplingParams())
    assert e.value.param == "prompt"
    assert e.value.num_tokens == MAX_MODEL_LEN and e.value.max_model_len == MAX_MODEL_LEN
    assert e.value.status_code == 400
    # One shorter fits, with exactly one token to generate.
    req = processor.process("r", {"prompt_token_ids": [7] * (MAX_MODEL_LEN - 1)}, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == 1


def test_long_text_prompt_too_long(processor: Processor) -> None:
    with pytest.raises(PromptTooLongError):
        processor.process("r", "hello " * MAX_MODEL_LEN, SamplingParams())


def test_request_fields_validated(processor: Processor) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process("", "hi", SamplingParams())
    assert param_of(e) == "request_id"
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", "hi", {"max_tokens": 3})  # type: ignore[arg-type]
    assert param_of(e) == "sampling_params"
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", "hi", SamplingParams(), priority="high")  # type: ignore[arg-type]
    assert param_of(e) == "priority"


# ---- sampling params resolution ------------------------------------------------------


def test_max_tokens_resolution(processor: Processor) -> None:
    ids = [9] * 10
    req = processor.process("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=None))
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - 10
    req = processor.process("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=7))
    assert req.sampling_params.max_tokens == 7
    req = processor.process("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=MAX_MODEL_LEN - 10))
    assert req.sampling_params.max_tokens == MAX_MODEL_LEN - 10


def test_max_tokens_too_large_names_field(processor: Processor) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", {"prompt_token_ids": [9] * 10}, SamplingParams(max_tokens=MAX_MODEL_LEN - 9))
    assert param_of(e) == "max_tokens"
    assert not isinstance(e.value, PromptTooLongError)


def test_min_tokens_beyond_room(processor: Processor) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", {"prompt_token_ids": [9] * 60}, SamplingParams(max_tokens=None, min_tokens=10))
    assert param_of(e) == "min_tokens"


def test_stop_ids_and_eos(processor: Processor) -> None:
    params = SamplingParams(stop_token_ids=[100, 200])
    req = processor.process("r", "hi", params)
    assert req.sampling_params.all_stop_token_ids == {100, 200, EOS}
    # The caller's object is untouched: a copy carries the resolution.
    assert req.sampling_params is not params
    assert params.all_stop_token_ids == {100, 200}
    assert params.max_tokens == 16
    req = processor.process("r", "hi", SamplingParams(stop_token_ids=[100], ignore_eos=True))
    assert req.sampling_params.all_stop_token_ids == {100}


def test_user_params_never_mutated(processor: Processor) -> None:
    params = SamplingParams(max_tokens=None, n=2, seed=3)
    before = repr(params)
    requests, _ = processor.process_with_fanout("r", {"prompt_token_ids": [9] * 4}, params)
    assert len(requests) == 2
    assert repr(params) == before and params.max_tokens is None


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (SamplingParams(logit_bias={VOCAB + 1: 1.0}), "logit_bias"),
        (SamplingParams(logprobs=DEFAULT_MAX_LOGPROBS + 1), "logprobs"),
        (SamplingParams(prompt_logprobs=DEFAULT_MAX_LOGPROBS + 1), "prompt_logprobs"),
    ],
)
def test_param_domain_errors(processor: Processor, params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process("r", "hi", params)
    assert param_of(e) == param


def test_logprobs_cap_is_configurable(model_config: ModelConfig, tiny_tokenizer: Any) -> None:
    strict = Processor(model_config, tiny_tokenizer, max_logprobs=2)
    strict.process("r", "hi", SamplingParams(logprobs=2))
    with pytest.raises(InvalidParameterError) as e:
        strict.process("r", "hi", SamplingParams(logprobs=3))
    assert param_of(e) == "logprobs"
    unlimited = Processor(model_config, tiny_tokenizer, max_logprobs=-1)
    unlimited.process("r", "hi", SamplingParams(logprobs=500, prompt_logprobs=VOCAB))


def test_logit_bias_in_vocab_ok(processor: Processor) -> None:
    req = processor.process("r", "hi", SamplingParams(logit_bias={0: 1.0, VOCAB - 1: -1.0}))
    assert req.sampling_params.logit_bias == {0: 1.0, VOCAB - 1: -1.0}


# ---- n > 1 fan-out --------------------------------------------------------------------


def test_fan_out_seeded(processor: Processor) -> None:
    params = SamplingParams(n=3, seed=11, stop_token_ids=[50])
    parent = processor.process("req", "hi", params)
    children = fan_out(parent)
    assert [c.request_id for c in children] == ["0_req", "1_req", "2_req"]
    assert [child_request_id(i, "req") for i in range(3)] == ["0_req", "1_req", "2_req"]
    assert [c.sampling_params.seed for c in children] == [11, 12, 13]
    for child in children:
        assert child.sampling_params.n == 1
        assert child.sampling_params.all_stop_token_ids == {50, EOS}
        assert child.sampling_params.max_tokens == parent.sampling_params.max_tokens
        assert child.prompt_token_ids == parent.prompt_token_ids
        assert child.arrival_time == parent.arrival_time
    assert parent.sampling_params.n == 3 and parent.sampling_params.seed == 11


def test_fan_out_unseeded_and_single(processor: Processor) -> None:
    children = fan_out(processor.process("q", "hi", SamplingParams(n=2)))
    assert all(c.sampling_params.seed is None and c.sampling_params.n == 1 for c in children)
    assert children[0].sampling_params.all_stop_token_ids == {EOS}
    single = processor.process("s", "hi", SamplingParams())
    assert fan_out(single) == [single]
    requests, text = processor.process_with_fanout("s", {"prompt": "hi"}, SamplingParams())
    assert [r.request_id for r in requests] == ["s"] and text == "hi"


# ---- chat -------------------------------------------------------------------------------


def test_chat_template_path(processor: Processor, tiny_tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = processor.render_chat(messages)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    req = processor.process_chat("c", messages, SamplingParams(max_tokens=4))
    assert req.prompt_token_ids == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert req.prompt_token_ids[0] == 3  # <|im_start|> as one special token, not its characters


def test_chat_without_generation_prompt_and_continue(processor: Processor) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the"}]
    closed = processor.render_chat(messages, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nthe<|im_end|>\n")
    open_turn = processor.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert open_turn.endswith("<|im_start|>assistant\nthe")
    with pytest.raises(InvalidParameterError) as e:
        processor.render_chat(messages, add_generation_prompt=True, continue_final_message=True)
    assert param_of(e) == "continue_final_message"


def test_chat_content_parts_and_kwargs(processor: Processor) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\na\nb<|im_end|>" in processor.render_chat(parts)
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    rendered = processor.render_chat(
        [{"role": "user", "content": "x"}], chat_template=template, chat_template_kwargs={"greeting": "hey"}
    )
    assert rendered == "hey[x]"
    with pytest.raises(InvalidParameterError) as e:
        processor.render_chat(parts, chat_template_kwargs={"tokenize": True})
    assert param_of(e) == "chat_template_kwargs"


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hello",
        [{"content": "no role"}],
        ["not a dict"],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 5}],
    ],
)
def test_bad_messages(processor: Processor, messages: Any) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.process_chat("c", messages, SamplingParams())
    assert param_of(e) == "messages"


def test_template_errors_are_client_errors(processor: Processor) -> None:
    with pytest.raises(InvalidParameterError) as e:
        processor.render_chat([{"role": "user", "content": "x"}], chat_template="{% if %}")
    assert param_of(e) == "messages"
    raising = "{{ raise_exception('only user turns') }}"
    with pytest.raises(InvalidParameterError, match="only user turns"):
        processor.render_chat([{"role": "user", "content": "x"}], chat_template=raising)


def test_no_chat_template(processor: Processor, tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiny_tokenizer, "chat_template", None)
    with pytest.raises(InvalidParameterError) as e:
        processor.render_chat([{"role": "user", "content": "x"}])
    assert param_of(e) == "chat_template"


# ---- tokenizer & EOS ------------------------------------------------------------------


def test_get_tokenizer_is_fast(tiny_tokenizer: Any) -> None:
    assert tiny_tokenizer.is_fast and len(tiny_tokenizer) == VOCAB
    assert tiny_tokenizer.eos_token_id == EOS


def test_get_tokenizer_bad_path(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError) as e:
        get_tokenizer(tmp_path / "missing")
    assert param_of(e) == "tokenizer"


def test_eos_ids_from_generation_config(tiny_model_dir: Path, tiny_tokenizer: Any, tmp_path: Path) -> None:
    assert get_eos_token_ids(tiny_tokenizer, tiny_model_dir) == [EOS]
    assert get_eos_token_ids(tiny_tokenizer, None) == [EOS]
    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2, 3]}))
    # The tokenizer's EOS leads, then the generation config's extras in order.
    assert get_eos_token_ids(tiny_tokenizer, model) == [EOS, 4, 3]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert load_generation_config_eos_ids(model) == [4]
    # Without a generation config, config.json's ids count.
    (model / "generation_config.json").unlink()
    (model / "config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    assert load_generation_config_eos_ids(model) == [2, 4]
    assert load_generation_config_eos_ids(tmp_path / "nowhere") == []


def test_processor_uses_all_eos_ids(tiny_model_dir: Path, tiny_tokenizer: Any, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model_dir / "config.json", model / "config.json")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    config = ModelConfig.from_path(str(model), None, "auto", MAX_MODEL_LEN, 0, "cpu")
    proc = Processor(config, tiny_tokenizer)
    req = proc.process("r", "hi", SamplingParams())
    assert req.eos_token_id == EOS
    assert req.sampling_params.all_stop_token_ids == {2, 4}
    assert proc.process("r", "hi", SamplingParams(ignore_eos=True)).sampling_params.all_stop_token_ids == set()
    override = Processor(config, tiny_tokenizer, eos_token_ids=[4])
    assert override.process("r", "hi", SamplingParams()).eos_token_id == 4
