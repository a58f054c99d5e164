"""What a server replica hands the router ingress in front of it: its
routes by method and path, and an answer in parts (a head, then a stream's
chunks, the first at once and the rest gathered), whose closing ends the
stream's requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from fastapi.responses import JSONResponse, StreamingResponse

from rayvllm.entrypoints.openai.forwarding import ResponseHead, StreamPacer, response_parts
from rayvllm.entrypoints.openai.streams import EventStream


def _pacer(interval_s: float) -> StreamPacer:
    return StreamPacer(min_interval_s=interval_s, max_interval_s=interval_s)


def _parts(response: object, interval_s: float = 0.02) -> list:
    async def collect() -> list:
        return [p async for p in response_parts(response, _pacer(interval_s))]  # type: ignore[arg-type]

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

    head, *parts = _parts(StreamingResponse(events(), media_type="text/event-stream"), 0.005)
    assert head.body is None and head.status == 200
    assert "".join(parts) == "".join(f"data: {i}\n\n" for i in range(30))
    assert 1 < len(parts) < 30  # gathered, in more than one window


def test_the_first_chunks_go_at_once_and_the_last_when_the_stream_ends() -> None:
    """A window of an hour: the first chunk is not held for it, and the
    stream's end sends what the window gathered (else this waits an hour
    and fails at the 30 s bound)."""
    first_read = asyncio.Event()

    async def events() -> AsyncGenerator[str, None]:
        yield "data: a\n\n"
        await first_read.wait()  # the rest is made only once the first was read
        yield "data: b\n\n"
        yield "data: c\n\n"

    async def collect() -> list:
        parts = []
        async for part in response_parts(StreamingResponse(events()), _pacer(3600.0)):
            parts.append(part)
            if len(parts) == 2:  # the head, then the first chunk
                first_read.set()
        return parts

    head, first, last = asyncio.run(asyncio.wait_for(collect(), 30))
    assert (head.body, first, last) == (None, "data: a\n\n", "data: b\n\ndata: c\n\n")


def test_a_failing_stream_sends_what_it_made_then_its_error() -> None:
    async def events() -> AsyncGenerator[str, None]:
        yield "data: a\n\n"
        yield "data: b\n\n"
        raise RuntimeError("the engine died")

    async def collect(seen: list) -> None:
        async for part in response_parts(StreamingResponse(events()), _pacer(3600.0)):
            seen.append(part)

    seen: list = []
    with pytest.raises(RuntimeError, match="the engine died"):
        asyncio.run(asyncio.wait_for(collect(seen), 30))
    assert "".join(seen[1:]) == "data: a\n\ndata: b\n\n"


def test_the_window_widens_with_the_streams_open() -> None:
    pacer = StreamPacer(min_interval_s=0.02, max_interval_s=0.25, messages_per_s=400.0)
    widths = []
    for open_streams in (0, 1, 8, 64, 100, 1000):
        pacer.open_streams = open_streams
        widths.append(pacer.interval_s())
    assert widths == [0.02, 0.02, 0.02, 0.16, 0.25, 0.25]
    with pacer.pacing(), pacer.pacing():
        assert pacer.open_streams == 1002
    assert pacer.open_streams == 1000


@pytest.mark.parametrize("parts_read", [1, 2], ids=["after-the-head", "mid-stream"])
def test_closing_ends_the_streams_requests(parts_read: int) -> None:
    closed: list[bool] = []

    async def events() -> AsyncGenerator[str, None]:
        yield "data: 0\n\n"
        await asyncio.sleep(3600)  # never passed: the reader leaves before
        yield "data: 1\n\n"

    async def on_close() -> None:
        closed.append(True)

    async def read_and_leave() -> tuple[list, set]:
        parts = response_parts(StreamingResponse(EventStream(events(), on_close)), StreamPacer())
        read = [await anext(parts) for _ in range(parts_read)]
        await parts.aclose()
        return read, asyncio.all_tasks() - {asyncio.current_task()}

    read, tasks_left = asyncio.run(read_and_leave())
    assert read[0].body is None and read[1:] == ["data: 0\n\n"][: parts_read - 1]
    assert closed == [True] and not tasks_left


API_ROUTES = [
    ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/detokenize"), ("POST", "/tokenize"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
]
CONTROL_ROUTES = [
    ("GET", "/is_paused"), ("GET", "/is_sleeping"), ("POST", "/finish_weight_update"),
    ("POST", "/init_weight_transfer_engine"), ("POST", "/pause"), ("POST", "/reset_prefix_cache"), ("POST", "/resume"),
    ("POST", "/sleep"), ("POST", "/start_weight_update"), ("POST", "/update_weights"), ("POST", "/wake_up"),
]
ADAPTER_ROUTES = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]


@pytest.mark.parametrize(("options", "expected"), [
    ({}, API_ROUTES),
    ({"enable_control_plane": True, "api_key": "k"}, API_ROUTES + CONTROL_ROUTES),
    ({"allow_runtime_lora_updating": True, "admin_api_key": "a"}, API_ROUTES + ADAPTER_ROUTES),
    ({"enable_control_plane": True, "allow_runtime_lora_updating": True, "port_is_private": True},
     API_ROUTES + CONTROL_ROUTES + ADAPTER_ROUTES),
])
def test_the_server_mounts_and_forwards_the_routes_its_options_turn_on(
    options: dict[str, Any], expected: list[tuple[str, str]]
) -> None:
    """The server's FastAPI app (what `serve run` serves) and the table the
    router ingress forwards by hold the same routes: the API's always, the
    control plane's and runtime LoRA loading's only when their option is on."""
    from fastapi.routing import APIRoute

    from rayvllm.entrypoints.openai.api_server import server_app, server_routes
    from rayvllm.entrypoints.openai.server_args import Plane, ServerArgs

    planes = ServerArgs(**options).access().planes
    routes = server_routes(planes)
    assert sorted(routes) == sorted(expected)
    mounted = sorted((m, r.path) for r in server_app(planes).routes if isinstance(r, APIRoute) for m in r.methods)
    assert mounted == sorted(expected)
    wide = sorted(path for (_, path), spec in routes.items() if spec.replica_wide)
    assert wide == sorted(p for m, p in CONTROL_ROUTES if m == "POST" and (m, p) in expected)
    public = {key for key, spec in routes.items() if spec.public}
    assert public == {("GET", "/health"), ("GET", "/metrics")}
    assert not routes[("GET", "/v1/models")].reads_body
    assert {spec.plane for key, spec in routes.items() if key in CONTROL_ROUTES} <= {Plane.CONTROL}
    assert {spec.plane for key, spec in routes.items() if key in ADAPTER_ROUTES} <= {Plane.ADAPTERS}


class _NoServer:
    """A server handle that must not be called: a route the router does not forward never reaches it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the router called its servers' {name}")


def _router(options: dict[str, Any]) -> Any:
    """The router ingress's own class (Serve left out), set up as its
    `__init__` sets the parts `forward` reads."""
    from rayvllm.entrypoints.openai.api_server import server_routes
    from rayvllm.entrypoints.openai.router_ingress import OpenAIRouter
    from rayvllm.entrypoints.openai.server_args import ServerArgs

    router = object.__new__(OpenAIRouter.func_or_class)
    args = ServerArgs(**options)
    router.access, router.max_request_bytes, router._server = args.access(), args.max_request_bytes, _NoServer()
    router.routes = server_routes(router.access.planes)
    return router


def _forward(router: Any, method: str, path: str, authorization: str | None = None) -> tuple[int, bytes]:
    from starlette.requests import Request

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    response = asyncio.run(type(router).forward(router, path.lstrip("/"), Request(scope, receive)))
    return response.status_code, bytes(response.body)


def test_the_router_ingress_forwards_no_control_route_by_default() -> None:
    """In front of several replicas, the router ingress (its real `forward`)
    answers every control-plane and runtime LoRA route as an unknown path
    unless the options mount it; mounted, it wants the admin key before
    any replica hears of the request."""
    default = _router({"api_key": "user"})
    unknown = _forward(default, "POST", "/no-such-route", "Bearer user")
    assert unknown[0] == 404
    admin_routes = sorted(set(CONTROL_ROUTES + ADAPTER_ROUTES))
    for method, path in admin_routes:
        assert _forward(default, method, path, "Bearer user") == unknown, path
    mounted = _router({"api_key": "user", "admin_api_key": "admin", "enable_control_plane": True,
                       "allow_runtime_lora_updating": True})
    for method, path in admin_routes:
        for authorization in (None, "Bearer user"):
            assert _forward(mounted, method, path, authorization)[0] == 401, (path, authorization)
