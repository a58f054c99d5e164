"""Structured outputs and tool calls through the official `openai` client
against a real `serve run` (one server for the module: each start costs
~20 s): OpenAI's response_format, vLLM's request fields, forced tool calls,
streamed equal to unstreamed, and 400s that name the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

from serve_harness import DIRECT_URL as BASE_URL, ServeProcess, served  # noqa: E402

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


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    with served(
        ["serve_app:build_app", f"model={tiny_model_dir}", "served_model_name=tiny", "max_num_seqs=8",
         "max_model_len=1024", "kv_cache_memory_bytes=33554432", "enable_auto_tool_choice=true",
         "tool_call_parser=hermes"],
        tmp_path_factory.mktemp("serve") / "serve.log",
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> "openai.OpenAI":
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
def test_bad_constraints_are_400_naming_the_field(server: ServeProcess, body: dict, param: str) -> None:
    response = requests.post(
        f"{BASE_URL}/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
