"""/v1/responses (stateless) under a real `serve run`, through the official
`openai` client: the text equals the same conversation through
/v1/chat/completions with the same (greedy) parameters, usage matches, the
streamed deltas join to the unstreamed text, and the events come in
OpenAI's order with consecutive sequence numbers. The fields a stateless
server cannot honour are 400s naming them. The "completed" ending (the
random model seldom stops before its limit) is checked against a scripted
engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import requests

openai = pytest.importorskip("openai")

from rayvllm.config import ModelConfig  # noqa: E402
from rayvllm.entrypoints.openai.responses_protocol import ResponsesRequest, ResponsesResponse  # noqa: E402
from rayvllm.entrypoints.openai.serving_responses import OpenAIServingResponses  # noqa: E402
from rayvllm.entrypoints.openai.streams import EventStream  # noqa: E402
from rayvllm.frontend.processor import Processor  # noqa: E402
from rayvllm.messages.outputs import CompletionOutput, RequestOutput  # noqa: E402
from rayvllm.messages.sampling_params import SamplingParams  # noqa: E402

from processor_engine import ProcessorEngine  # noqa: E402
from serve_harness import app_url  # noqa: E402

MODEL = "tiny"
MAX_TOKENS = 12
BASE_URL = app_url(__file__)
EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def serve_app_args(request: pytest.FixtureRequest) -> dict[str, object]:
    """This module's app on the shared server (conftest.serve_apps)."""
    return {"model": str(request.getfixturevalue("tiny_model_dir")), "served_model_name": MODEL, "max_num_seqs": 8,
            "max_model_len": 1024, "kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="module")
def client(serve_apps: None) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0)


def _chat(client: "openai.OpenAI", messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_equals_chat_completions(client: "openai.OpenAI") -> None:
    resp = client.responses.create(model=MODEL, input="Tell me about the river", max_output_tokens=MAX_TOKENS,
                                   temperature=0)
    chat = _chat(client, [{"role": "user", "content": "Tell me about the river"}])
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.max_output_tokens == MAX_TOKENS and resp.model == MODEL


def test_instructions_and_message_items(client: "openai.OpenAI") -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": "What is the story?"},
    ]
    resp = client.responses.create(model=MODEL, instructions="Be brief.", input=items,
                                   max_output_tokens=MAX_TOKENS, temperature=0)
    chat = _chat(client, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nthere"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "What is the story?"},
    ])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.instructions == "Be brief."
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_in_order_and_deltas_join(client: "openai.OpenAI") -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, input="A small house by the water", max_output_tokens=16,
                                  temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    ending = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == EVENT_ORDER + ["response.output_text.delta"] * len(deltas) + CLOSING + [ending]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    assert events[-4].text == text  # output_text.done
    assert events[-3].part.text == text  # content_part.done
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} and events[-2].item.id == item_id
    final = events[-1].response
    assert final.id == events[0].response.id and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert events[0].response.status == "in_progress"


def test_raw_sse_names_each_event(serve_apps: None) -> None:
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 3, "stream": True}
    with requests.post(f"{BASE_URL}/v1/responses", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = r.text.strip().split("\n\n")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert "[DONE]" not in r.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": -1}, "temperature"),
        # This server has no auto tool choice: tools without a choice mean "auto".
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ],
)
def test_bad_requests_name_the_field(serve_apps: None, body: dict, param: str) -> None:
    r = requests.post(f"{BASE_URL}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_on_a_generating_model_is_a_400(serve_apps: None) -> None:
    r = requests.post(f"{BASE_URL}/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "model" and "does not support embeddings" in error["message"]


def test_unknown_model_is_a_404(client: "openai.OpenAI") -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")


# ---- the completed ending, against a scripted engine ----------------------------------------


class _OneOutput:
    """An admitted request whose one output finishes with `finish_reason`."""

    def __init__(self, output: RequestOutput) -> None:
        self._outputs = [output]
        self.closed = False

    def __aiter__(self) -> "_OneOutput":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._outputs:
            raise StopAsyncIteration
        return self._outputs.pop()

    async def aclose(self) -> None:
        self.closed = True


class _ScriptedEngine(ProcessorEngine):
    def __init__(self, processor: Processor, text: str, finish_reason: str) -> None:
        super().__init__(processor, MODEL)
        self.text = text
        self.finish_reason = finish_reason

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, **_: Any) -> _OneOutput:
        request = self.processor.process(request_id, prompt, params, add_special_tokens=False)
        ids = self.processor.tokenize(self.text, add_special_tokens=False)
        completion = CompletionOutput(0, self.text, ids, None, None, finish_reason=self.finish_reason)
        return _OneOutput(RequestOutput(request_id, None, request.prompt_token_ids, None, [completion], True,
                                        num_cached_tokens=0))


@pytest.mark.parametrize("finish_reason, status", [("stop", "completed"), ("length", "incomplete")])
def test_ending_follows_the_finish_reason(tiny_model_dir: Path, tiny_tokenizer, finish_reason: str,
                                          status: str) -> None:
    config = ModelConfig.from_path(str(tiny_model_dir), None, "auto", 256, 0, "cpu")
    serving = OpenAIServingResponses(_ScriptedEngine(Processor(config, tiny_tokenizer), " the river", finish_reason),
                                     [MODEL], 256)
    req = ResponsesRequest(input="hi", max_output_tokens=4)
    whole = asyncio.run(serving.create_response(req, "resp_x"))
    assert isinstance(whole, ResponsesResponse) and whole.status == status
    assert whole.output[0].status == status and whole.output[0].content[0].text == " the river"
    assert (whole.incomplete_details is None) == (status == "completed")

    async def events() -> list[str]:
        stream = await serving.create_response(ResponsesRequest(input="hi", stream=True), "resp_y")
        assert isinstance(stream, EventStream)
        try:
            return [event async for event in stream]
        finally:
            await stream.aclose()

    last = asyncio.run(events())[-1]
    assert last.startswith(f"event: response.{status}\n")
    assert json.loads(last.split("data: ", 1)[1])["response"]["status"] == status


def test_auto_tool_call_text_and_call_items(tiny_model_dir: Path, tiny_tokenizer) -> None:
    """With "auto", the server's parser splits the model's text into a
    message and a function call item; streamed, the message closes before
    the call opens, and the final Response equals the unstreamed one."""
    config = ModelConfig.from_path(str(tiny_model_dir), None, "auto", 256, 0, "cpu")
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    serving = OpenAIServingResponses(_ScriptedEngine(Processor(config, tiny_tokenizer), text, "stop"), [MODEL], 256,
                                     enable_auto_tool_choice=True, tool_call_parser="hermes")
    tools = [{"type": "function", "name": "get_weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    whole = asyncio.run(serving.create_response(ResponsesRequest(input="hi", tools=tools), "resp_x"))
    assert isinstance(whole, ResponsesResponse) and whole.status == "completed"
    message, call = whole.output
    assert message.content[0].text == "Let me check. "
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")

    async def events() -> list[dict[str, Any]]:
        stream = await serving.create_response(ResponsesRequest(input="hi", tools=tools, stream=True), "resp_y")
        assert isinstance(stream, EventStream)
        try:
            return [json.loads(event.split("data: ", 1)[1]) async for event in stream]
        finally:
            await stream.aclose()

    got = asyncio.run(events())
    kinds = [e["type"] for e in got]
    text_deltas = kinds.count("response.output_text.delta")
    arg_deltas = kinds.count("response.function_call_arguments.delta")
    assert kinds == (EVENT_ORDER + ["response.output_text.delta"] * text_deltas + CLOSING
                     + ["response.output_item.added"] + ["response.function_call_arguments.delta"] * arg_deltas
                     + ["response.function_call_arguments.done", "response.output_item.done", "response.completed"])
    assert [e["output_index"] for e in got if e["type"] == "response.output_item.done"] == [0, 1]
    final = got[-1]["response"]["output"]
    assert final[0]["content"][0]["text"] == "Let me check. "
    assert (final[1]["name"], json.loads(final[1]["arguments"])) == ("get_weather", {"city": "Paris"})
