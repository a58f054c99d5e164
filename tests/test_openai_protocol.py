"""OpenAI protocol models: parsing, defaults, the mapping to SamplingParams,
400s that name the field, and OpenAI-style error bodies."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from rayvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UsageInfo,
    error_body,
    invalid_param_from_validation_error,
    parse_request,
    parse_tokenize_request,
    with_param,
)
from rayvllm.messages.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidParameterError,
    ModelNotFoundError,
    PromptTooLongError,
)
from rayvllm.messages.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "hi"}]
PARTS = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def chat_request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})


def param_of(exc: pytest.ExceptionInfo[InvalidParameterError]) -> str:
    return exc.value.param


# ---- parsing and defaults ------------------------------------------------------------


def test_completion_defaults_and_unknown_fields_ignored() -> None:
    req = parse_request(CompletionRequest, {"model": "m", "prompt": "hi", "no_such_field": 1, "metadata": {}})
    assert req.max_tokens == 16 and req.n == 1 and req.echo is False and req.add_special_tokens is True
    assert not hasattr(req, "no_such_field")
    params = req.to_sampling_params()
    assert params == SamplingParams(max_tokens=16)


def test_chat_defaults() -> None:
    req = parse_request(ChatCompletionRequest, {"messages": MESSAGES})
    assert req.model is None
    assert req.add_generation_prompt is True and req.continue_final_message is False
    assert req.add_special_tokens is False  # the template already holds the special tokens
    params = req.to_sampling_params()
    assert params.max_tokens is None  # up to max_model_len
    assert params.logprobs is None


def test_completion_prompt_forms() -> None:
    assert parse_request(CompletionRequest, {"prompt": "a"}).prompt == "a"
    assert parse_request(CompletionRequest, {"prompt": ["a", "b"]}).prompt == ["a", "b"]
    assert parse_request(CompletionRequest, {"prompt": [1, 2]}).prompt == [1, 2]
    assert parse_request(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]


def test_every_sampling_field_reaches_sampling_params() -> None:
    req = CompletionRequest(
        prompt="x",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        n=2,
        best_of=2,
        stop=["\n"],
        seed=11,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logprobs=3,
        logit_bias={"5": -1.5},
        top_k=4,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[9],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        spaces_between_special_tokens=False,
        prompt_logprobs=1,
    )
    assert req.to_sampling_params() == SamplingParams(
        n=2,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.05,
        seed=11,
        stop=["\n"],
        stop_token_ids=[9],
        ignore_eos=True,
        max_tokens=7,
        min_tokens=2,
        logprobs=3,
        prompt_logprobs=1,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={5: -1.5},
    )


def test_null_max_tokens_means_up_to_max_model_len() -> None:
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params().max_tokens is None


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert CompletionRequest(prompt="x", echo=True, logprobs=2).to_sampling_params().prompt_logprobs == 2
    assert CompletionRequest(prompt="x", logprobs=2).to_sampling_params().prompt_logprobs is None
    explicit = CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=0)
    assert explicit.to_sampling_params().prompt_logprobs == 0


def test_chat_max_completion_tokens_wins() -> None:
    req = chat_request(max_tokens=50, max_completion_tokens=5)
    assert req.to_sampling_params().max_tokens == 5
    assert chat_request(max_tokens=50).to_sampling_params().max_tokens == 50


def test_chat_logprobs_mapping() -> None:
    def logprobs(**kw: Any) -> int | None:
        return chat_request(**kw).to_sampling_params().logprobs

    assert logprobs() is None
    assert logprobs(logprobs=False) is None
    assert logprobs(logprobs=True) == 0
    assert logprobs(logprobs=True, top_logprobs=4) == 4
    assert logprobs(top_logprobs=0) is None  # 0 asks for nothing, so it needs no logprobs=true


def test_chat_messages_for_the_template() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": PARTS, "name": "u"},
                {"role": "assistant", "content": None},
            ],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": PARTS, "name": "u"},
        {"role": "assistant", "content": None},
    ]
    assert req.template_options() == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "chat_template": None,
        "chat_template_kwargs": {"enable_thinking": False},
    }


# ---- 400s that name the field ------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (CompletionRequest, {"prompt": 5}, "prompt"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),
        (CompletionRequest, {}, "prompt"),
        (CompletionRequest, {"prompt": "x", "suffix": "y"}, "suffix"),
        (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"5": "big"}}, "logit_bias"),
        (CompletionRequest, {"prompt": "x", "stop": 3}, "stop"),
        (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        (ChatCompletionRequest, {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        (ChatCompletionRequest, {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (ChatCompletionRequest, {"messages": MESSAGES, "max_completion_tokens": "many"}, "max_completion_tokens"),
        (ChatCompletionRequest, {}, "messages"),
    ],
)
def test_type_errors_name_the_field(model: type[Any], body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameterError) as exc:
        parse_request(model, body)
    assert param_of(exc) == param
    assert str(exc.value).startswith(f"{param}: ")
    assert error_body(exc.value)[0] == 400


def test_suffix_and_best_of_equal_to_n_are_fine_when_harmless() -> None:
    assert parse_request(CompletionRequest, {"prompt": "x", "n": 2, "best_of": 2}).best_of == 2
    assert parse_request(CompletionRequest, {"prompt": "x", "suffix": None}).suffix is None
    req = parse_request(CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert req.include_usage


def test_raw_json_body() -> None:
    assert parse_request(CompletionRequest, b'{"prompt": "x", "n": 3}').n == 3
    with pytest.raises(InvalidParameterError) as exc:
        parse_request(CompletionRequest, b'{"prompt": ')
    assert param_of(exc) == "body"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 200.0}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_completion_value_errors_name_the_field(kwargs: dict[str, Any], param: str) -> None:
    req = CompletionRequest(prompt="x", **kwargs)
    with pytest.raises(InvalidParameterError) as exc:
        req.to_sampling_params()
    assert param_of(exc) == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_chat_value_errors_use_the_chat_names(kwargs: dict[str, Any], param: str) -> None:
    req = chat_request(**kwargs)
    with pytest.raises(InvalidParameterError) as exc:
        req.to_sampling_params()
    assert param_of(exc) == param


def test_chat_translates_engine_side_names() -> None:
    req = chat_request(logprobs=True, top_logprobs=3, max_completion_tokens=4)
    assert req.openai_param("logprobs") == "top_logprobs"
    assert req.openai_param("max_tokens") == "max_completion_tokens"
    assert req.openai_param("prompt") == "messages"
    assert req.openai_param("temperature") == "temperature"
    plain = chat_request(logprobs=True)
    assert plain.openai_param("logprobs") == "logprobs" and plain.openai_param("max_tokens") == "max_tokens"
    assert CompletionRequest(prompt=[1]).openai_param("prompt_token_ids") == "prompt"


def test_with_param_keeps_class_and_attributes() -> None:
    original = PromptTooLongError(100, 64)
    renamed = with_param(original, "messages")
    assert type(renamed) is PromptTooLongError
    assert renamed.param == "messages" and renamed.num_tokens == 100 and renamed.max_model_len == 64
    assert str(renamed).startswith("messages: the prompt has 100 tokens")
    assert original.param == "prompt"  # not mutated
    same = InvalidParameterError("n", "bad")
    assert with_param(same, "n") is same


# ---- error bodies ---------------------------------------------------------------------------


def test_error_body_shapes() -> None:
    assert error_body(InvalidParameterError("temperature", "must be >= 0, got -1")) == (
        400,
        {
            "error": {
                "message": "temperature: must be >= 0, got -1",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": 400,
            }
        },
    )
    status, body = error_body(PromptTooLongError(70, 64))
    assert status == 400 and body["error"]["param"] == "prompt" and "70 tokens" in body["error"]["message"]
    status, body = error_body(ModelNotFoundError("The model `x` does not exist."))
    assert status == 404
    assert body == {
        "error": {"message": "The model `x` does not exist.", "type": "not_found_error", "param": None, "code": 404}
    }
    for exc in (EngineOverloadedError("busy"), EngineDeadError("dead")):
        status, body = error_body(exc)
        assert status == 503 and body["error"]["type"] == "service_unavailable" and body["error"]["code"] == 503
    assert error_body(EngineOverloadedError("busy"))[1]["error"]["message"] == "busy"
    # A dead engine's cause names nodes and addresses: the body does not.
    dead = EngineDeadError("worker rank 1 (node 10.0.0.7 id 4f2a) is gone")
    assert error_body(dead)[1]["error"]["message"] == "the engine is not available; retry later"
    # An unexpected exception's text can hold anything: the body says only that it failed.
    assert error_body(RuntimeError("prompt 'secret' at /home/x")) == (
        500,
        {"error": {"message": "internal server error", "type": "internal_error", "param": None, "code": 500}},
    )


def test_error_body_of_a_validation_error() -> None:
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": "x", "top_p": "high"})
    assert invalid_param_from_validation_error(exc.value).param == "top_p"
    status, body = error_body(exc.value)
    assert status == 400 and body["error"]["param"] == "top_p" and body["error"]["type"] == "invalid_request_error"


# ---- tokenize requests and response shapes ----------------------------------------------------


def test_tokenize_request_forms() -> None:
    completion = parse_tokenize_request({"prompt": "hi"})
    assert isinstance(completion, TokenizeCompletionRequest) and completion.add_special_tokens is True
    chat = parse_tokenize_request({"messages": MESSAGES})
    assert isinstance(chat, TokenizeChatRequest) and chat.add_special_tokens is False
    with pytest.raises(InvalidParameterError) as exc:
        parse_tokenize_request({"model": "m"})
    assert param_of(exc) == "prompt"


def test_response_ids_objects_and_json() -> None:
    response = CompletionResponse(
        model="m", choices=[CompletionResponseChoice(index=0, text="t", finish_reason="stop")], usage=UsageInfo()
    )
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", response.id)
    assert response.object == "text_completion" and isinstance(response.created, int)
    chunk = ChatCompletionStreamResponse(
        model="m",
        choices=[ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="x"))],
    )
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chunk.id)
    dumped = chunk.model_dump()
    assert dumped["object"] == "chat.completion.chunk"
    # Unset delta fields are left out; nulls elsewhere stay, as OpenAI sends them.
    assert dumped["choices"] == [
        {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]
    models = ModelList(data=[ModelCard(id="m", max_model_len=64)]).model_dump()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == 64 and models["data"][0]["owned_by"] == "rayvllm"
