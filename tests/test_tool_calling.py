"""Tool calling: the `hermes` and `llama3_json` parsers on fixed texts
(whole and streamed in every cut), and forced calls (`tool_choice`
"required" or a named function) through `OpenAIServing` over the real
engine, where only the grammar makes a random model's arguments parse."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from rayvllm.actors.factory import async_llm_from_engine_args

from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.entrypoints.openai.chat_tools import ChatTools
from rayvllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, parse_request
from rayvllm.entrypoints.openai.serving import EventStream, OpenAIServing
from rayvllm.entrypoints.openai.tool_parsers import get_tool_parser
from rayvllm.messages.errors import InvalidParameterError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]

HERMES_TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {"utc": true}}</tool_call>'
)
LLAMA_TEXT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; {"name": "get_time", "parameters": {"utc": false}}'


def _streamed(parser_name: str, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) calls from `text` fed `size` chars at a time."""
    parser = get_tool_parser(parser_name)()
    content, calls = "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        part = parser.extract_tool_calls_streaming(piece, final=i == len(pieces) - 1)
        content += part.content
        for call in part.tool_calls:
            assert call.index == len(calls) and call.id and call.function is not None
            calls.append((call.function.name, call.function.arguments))
    return content, calls


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", HERMES_TEXT, "Let me check. ",
         [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"utc": True})]),
        ("hermes", "no tools <tool here", "no tools <tool here", []),
        ("hermes", 'cut <tool_call>{"name": "get_time", "arguments": {"utc": true}}', "cut ",
         [("get_time", {"utc": True})]),
        ("hermes", "bad <tool_call>{not json}</tool_call>", "bad <tool_call>{not json}</tool_call>", []),
        ("llama3_json", LLAMA_TEXT, "",
         [("get_weather", {"city": "Oslo", "days": 1}), ("get_time", {"utc": False})]),
        ("llama3_json", ' {"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
        ("llama3_json", "It is sunny.", "It is sunny.", []),
        ("llama3_json", '{"name": "get_time", "para', '{"name": "get_time", "para', []),
    ],
)
def test_parsers_whole_and_streamed(parser: str, text: str, content: str, calls: list[tuple[str, dict]]) -> None:
    whole = get_tool_parser(parser)().extract_tool_calls(text)
    assert whole.tools_called == bool(calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == calls
    assert (whole.content or "") == content
    for size in (1, 2, 3, 7, len(text)):
        got_content, got_calls = _streamed(parser, text, size)
        assert got_content == content, size
        assert [(n, json.loads(a)) for n, a in got_calls] == calls, size


def _request(**body: Any) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, {"messages": MESSAGES, **body})


def test_tool_choice_rules() -> None:
    assert _request().tool_choice_mode == "none"
    assert _request(tools=[WEATHER]).tool_choice_mode == "auto"
    cases = [
        (dict(tools=[WEATHER]), False, "tool_choice"),  # auto, but the server does not allow it
        (dict(tool_choice="required"), True, "tool_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), True, "tool_choice"),
    ]
    for body, auto, param in cases:
        with pytest.raises(InvalidParameterError) as info:
            ChatTools.from_request(_request(**body), auto, "hermes" if auto else None)
        assert info.value.param == param
    with pytest.raises(InvalidParameterError) as info:
        _request(functions=[{"name": "f"}])
    assert info.value.param == "functions"
    single = ChatTools.from_request(_request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), False, None)
    assert single is not None and single.constraint is not None
    assert json.loads(single.constraint.spec)["maxItems"] == 1


# ---- through OpenAIServing and the real engine ----------------------------------------


@pytest.fixture(scope="module")
def serving(tiny_model_dir: Path) -> Iterator[tuple[OpenAIServing, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    args = EngineArgs(model=str(tiny_model_dir), max_num_seqs=8, max_model_len=1024, kv_cache_memory_bytes=32 << 20)
    engine = loop.run_until_complete(_make_engine(args))
    yield OpenAIServing(engine, ["tiny"], 1024, enable_auto_tool_choice=True, tool_call_parser="hermes"), loop
    loop.run_until_complete(_shutdown(engine))
    loop.close()


async def _make_engine(args: EngineArgs) -> AsyncLLM:
    return async_llm_from_engine_args(args)


async def _shutdown(engine: AsyncLLM) -> None:
    engine.shutdown()


def _chat(serving: tuple[OpenAIServing, asyncio.AbstractEventLoop], body: dict[str, Any]) -> Any:
    api, loop = serving

    async def run() -> Any:
        result = await api.create_chat_completion(_request(**body), "chatcmpl-test")
        if isinstance(result, EventStream):
            return [event async for event in result]
        return result

    return loop.run_until_complete(run())


def _stream_calls(events: list[str]) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) per call rebuilt from SSE deltas, and the finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for event in events:
        payload = event.removeprefix("data: ").strip()
        if payload == "[DONE]":
            continue
        for choice in json.loads(payload)["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call.get("function", {}).get("name") or ""
                entry[1] += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize("seed", range(6))
def test_required_tool_calls_always_validate(serving: Any, seed: int) -> None:
    body = dict(tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
    response = _chat(serving, body)
    assert isinstance(response, ChatCompletionResponse)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed, finish = _stream_calls(_chat(serving, body | {"stream": True}))
    assert finish == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_named_function_is_called_with_valid_arguments(serving: Any) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(4):
        body = dict(tools=[WEATHER, TIME], tool_choice=named, temperature=1.0, seed=seed, max_tokens=100)
        response = _chat(serving, body)
        (call,) = response.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and response.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert _stream_calls(_chat(serving, body | {"stream": True})) == (
            [("get_weather", call.function.arguments)], "tool_calls"
        )


def test_auto_with_a_model_that_calls_nothing_is_plain_text(serving: Any) -> None:
    response = _chat(serving, dict(tools=[WEATHER], temperature=0.0, max_tokens=8))
    choice = response.choices[0]
    assert not choice.message.tool_calls and choice.message.content and choice.finish_reason != "tool_calls"
    prompt = serving[0].engine.processor.render_chat(MESSAGES, tools=[WEATHER])
    assert "<tools>" in prompt and '"get_weather"' in prompt


def test_tool_choice_none_and_a_multi_turn_conversation(serving: Any) -> None:
    """"none" renders the tools but parses nothing; earlier calls and their
    results reach the model through the template."""
    turns = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]
    response = _chat(serving, dict(messages=turns, tools=[WEATHER], tool_choice="none", temperature=0.0, max_tokens=6))
    choice = response.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
    prompt = serving[0].engine.processor.render_chat(_request(messages=turns).template_messages(), tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
