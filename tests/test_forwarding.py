"""What a server replica hands the router ingress in front of it: its
routes by method and path, and an answer in parts (a head, then a stream's
chunks, the first at once and the rest gathered), whose closing ends the
stream's requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse, StreamingResponse

from rayvllm.entrypoints.openai.forwarding import ResponseHead, response_parts
from rayvllm.entrypoints.openai.streams import EventStream


def _parts(response: object, interval_s: float = 0.02) -> list:
    async def collect() -> list:
        return [p async for p in response_parts(response, interval_s)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_a_whole_answer_is_one_head_with_its_body() -> None:
    (head,) = _parts(JSONResponse({"a": 1}, status_code=400, headers={"x-k": "v"}))
    assert (head.status, head.body, sorted(head.headers)) == (400, b'{"a":1}', [("content-type", "application/json"), ("x-k", "v")])


def test_a_streams_chunks_arrive_whole_and_in_order() -> None:
    async def events() -> AsyncGenerator[str, None]:
        for i in range(30):
            if i % 7 == 0:
                await asyncio.sleep(0.001)  # some chunks come in one window, some in another
            yield f"data: {i}\n\n"

    head, first, *rest = _parts(StreamingResponse(events(), media_type="text/event-stream"), 0.005)
    assert head.body is None and head.status == 200
    assert first == "data: 0\n\n"  # the first goes out alone, at once
    assert first + "".join(rest) == "".join(f"data: {i}\n\n" for i in range(30))


def test_closing_after_the_head_ends_the_streams_requests() -> None:
    closed: list[bool] = []

    async def events() -> AsyncGenerator[str, None]:
        yield "data: 0\n\n"
        await asyncio.sleep(3600)  # never reached: the reader leaves after the head
        yield "data: 1\n\n"

    async def on_close() -> None:
        closed.append(True)

    async def read_head_and_leave() -> ResponseHead:
        parts = response_parts(StreamingResponse(EventStream(events(), on_close)))
        head = await anext(parts)
        await parts.aclose()
        return head  # type: ignore[return-value]

    assert asyncio.run(read_head_and_leave()).body is None
    assert closed == [True]


def test_the_server_forwards_every_route_it_serves() -> None:
    from rayvllm.entrypoints.openai.api_server import FORWARDED_ROUTES

    assert sorted(FORWARDED_ROUTES) == [
        ("GET", "/health"), ("GET", "/is_paused"), ("GET", "/metrics"), ("GET", "/v1/models"),
        ("POST", "/detokenize"), ("POST", "/finish_weight_update"), ("POST", "/init_weight_transfer_engine"),
        ("POST", "/pause"), ("POST", "/reset_prefix_cache"), ("POST", "/resume"), ("POST", "/start_weight_update"),
        ("POST", "/tokenize"), ("POST", "/update_weights"), ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/responses"), ("POST", "/v1/unload_lora_adapter"),
    ]
    wide = sorted(path for (_, path), spec in FORWARDED_ROUTES.items() if spec.replica_wide)
    assert wide == [
        "/finish_weight_update", "/init_weight_transfer_engine", "/pause", "/reset_prefix_cache", "/resume",
        "/start_weight_update", "/update_weights",
    ]
    public = {key for key, spec in FORWARDED_ROUTES.items() if spec.public}
    assert public == {("GET", "/health"), ("GET", "/metrics")}
    assert not FORWARDED_ROUTES[("GET", "/v1/models")].reads_body
