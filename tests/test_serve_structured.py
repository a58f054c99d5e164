"""Structured outputs and tool calls through the official `openai` client
against a real `serve run` (one server for the module: each start costs
~20 s): OpenAI's response_format, vLLM's request fields, forced tool calls,
streamed equal to unstreamed, and 400s that name the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from serve_harness import app_url  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
BASE_URL = app_url(__file__)


def serve_app_args(request: pytest.FixtureRequest) -> dict[str, object]:
    """This module's app on the shared server (conftest.serve_apps), with tool calls parsed."""
    return {"model": str(request.getfixturevalue("tiny_model_dir")), "served_model_name": "tiny", "max_num_seqs": 8,
            "max_model_len": 1024, "kv_cache_memory_bytes": 32 << 20, "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes"}


@pytest.fixture(scope="module")
def client(serve_apps: None) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0)


def test_json_schema_response_format_streamed_and_not(client: "openai.OpenAI") -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for seed in range(4):
        kwargs = dict(model="tiny", messages=MESSAGES, response_format=fmt, temperature=1.0, seed=seed, max_tokens=100)
        whole = client.chat.completions.create(**kwargs)
        text = whole.choices[0].message.content
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        stream = client.chat.completions.create(stream=True, **kwargs)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_vllm_fields_on_completions(client: "openai.OpenAI") -> None:
    out = client.completions.create(
        model="tiny", prompt="Color:", max_tokens=20, temperature=1.0, seed=1,
        extra_body={"guided_regex": r"(red|blue)-[0-9]{2}"},
    )
    assert re.fullmatch(r"(red|blue)-[0-9]{2}", out.choices[0].text)
    out = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=20, extra_body={"structured_outputs": {"choice": ["up", "down"]}}
    )
    assert out.choices[0].text in ("up", "down")
    obj = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, response_format={"type": "json_object"}, temperature=0.0
    ).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


def test_required_and_named_tool_calls(client: "openai.OpenAI") -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice=choice, seed=3,
                      temperature=1.0, max_tokens=100)
        out = client.chat.completions.create(**kwargs).choices[0]
        assert out.finish_reason == "tool_calls"
        (call,) = out.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        args = "".join(
            tc.function.arguments or ""
            for chunk in client.chat.completions.create(stream=True, **kwargs) if chunk.choices
            for tc in chunk.choices[0].delta.tool_calls or []
        )
        assert args == call.function.arguments


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"guided_regex": "(open"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(serve_apps: None, body: dict, param: str) -> None:
    response = requests.post(
        f"{BASE_URL}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- tool_choice "auto": calls parsed from the model's own text ------------------------------

# A random model never writes a hermes call by itself; this regex (vLLM's
# structured_outputs, which "auto" leaves free) makes it write one, so the
# server's hermes parser, not a constraint of its own, finds the call.
HERMES_CALL = r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'


def test_auto_tool_call_is_parsed_streamed_and_not(client: "openai.OpenAI") -> None:
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], seed=3, temperature=1.0, max_tokens=100,
                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure. "
    (call,) = out.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(tc.function.name, tc.function.arguments) for tc in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ("Sure. ", "tool_calls")
    assert calls == [(call.function.name, call.function.arguments)]


# ---- /v1/responses: function tools and text.format ------------------------------------------

RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_forced_function_calls_streamed_and_not(client: "openai.OpenAI") -> None:
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kwargs = dict(model="tiny", input="Weather in Oslo?", tools=[RESPONSES_WEATHER], tool_choice=choice,
                      temperature=0.0, max_output_tokens=100)
        whole = client.responses.create(**kwargs)
        assert whole.status == "completed"
        (call,) = whole.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
        assert whole.tools[0].name == "get_weather"
        events = list(client.responses.create(stream=True, **kwargs))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        kinds = [e.type for e in events]
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                         + ["response.function_call_arguments.delta"] * len(deltas)
                         + ["response.function_call_arguments.done", "response.output_item.done",
                            "response.completed"])
        assert "".join(deltas) == events[-3].arguments == call.arguments
        final = events[-1].response
        assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", "get_weather", call.arguments)]


def test_responses_function_call_turns_render_as_chat_tool_turns(client: "openai.OpenAI") -> None:
    """An earlier call and its output, as Responses input items, reach the
    model as the chat template's assistant tool call and tool message: the
    same prompt as the chat conversation, token for token."""
    args = '{"city": "Paris"}'
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    resp = client.responses.create(model="tiny", input=items, tools=[RESPONSES_WEATHER], tool_choice="none",
                                   temperature=0.0, max_output_tokens=4)
    chat = client.chat.completions.create(
        model="tiny", tools=[WEATHER], tool_choice="none", temperature=0.0, max_tokens=4,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.output_text == chat.choices[0].message.content


def test_responses_text_format_json_schema(client: "openai.OpenAI") -> None:
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}
    for seed_text in ("Describe ada.", "Describe bob.", "Someone else."):
        resp = client.responses.create(model="tiny", input=seed_text, text=fmt, temperature=0.0,
                                       max_output_tokens=60)
        if resp.status == "completed":
            jsonschema.validate(json.loads(resp.output_text), SCHEMA)
        else:  # cut by the limit: still a prefix the grammar allowed
            assert resp.output_text.startswith("{")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [RESPONSES_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": [RESPONSES_WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"text": {"format": {"type": "xml"}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ],
)
def test_responses_bad_tools_and_formats_are_400_naming_the_field(serve_apps: None, body: dict,
                                                                   param: str) -> None:
    response = requests.post(f"{BASE_URL}/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
