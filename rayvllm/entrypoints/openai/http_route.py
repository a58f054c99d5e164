"""`openai_route`: the one wrapper every HTTP route of the server goes through.

It authorizes the caller, reads the body (bounded) into the route's
request type, runs the route's own work, and turns what that returns into
a response; every exception becomes an OpenAI error body with the status
of the `RayvllmError` raised (`protocol.error_body`), and an overload's
503 carries `Retry-After`. A route body therefore holds only its own work.
"""

import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from rayvllm.entrypoints.openai.protocol import error_body, parse_request
from rayvllm.entrypoints.openai.server_args import Plane, RouteAccess
from rayvllm.messages.errors import (
    AuthenticationError,
    EngineOverloadedError,
    InvalidParameterError,
    RequestTooLargeError,
)

__all__ = [
    "FORWARDED_ATTR", "PLANE_ATTR", "PUBLIC_ATTR", "READS_BODY_ATTR", "REPLICA_WIDE_ATTR", "RETRY_AFTER_S",
    "RouteOwner", "mount_routes", "openai_route", "served_at",
]

# Clients told to come back after an overload wait this long (seconds).
RETRY_AFTER_S = 1
# The attribute of a route's handler that answers a body read elsewhere
# (`forwarded(self, data)`): what a replica behind the router ingress runs.
FORWARDED_ATTR = "forwarded"
# The attribute that marks a route public (no API key: probes, scrapers).
PUBLIC_ATTR = "public"
# The attribute that says whether a route reads a body (a POST may have none).
READS_BODY_ATTR = "reads_body"
# The attribute that marks a route every replica must answer (a weight
# update, a pause): the router ingress sends it to all of them.
REPLICA_WIDE_ATTR = "replica_wide"
# The attribute that names a route's `Plane` (which option mounts it, which key it takes).
PLANE_ATTR = "plane"
# The attribute that holds a route's (method, path) (`served_at`).
HTTP_ATTR = "http"

# What a route body may return: a ready response, a pydantic body (sent as
# JSON), or a stream of server-sent events.
Reply = Response | BaseModel | AsyncIterator[str]
RouteBody = Callable[..., Awaitable[Reply]]
Handler = Callable[[Any, Request], Awaitable[Response]]


class RouteOwner(Protocol):
    """The object whose methods are the routes (a Serve ingress class)."""

    access: RouteAccess
    max_request_bytes: int | None


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, EngineOverloadedError) else None
    return JSONResponse(body, status_code=status, headers=headers)


def authorize(request: Request, keys: tuple[str, ...]) -> None:
    """Where `keys` holds any, a request needs `Authorization: Bearer <key>`
    with one of them (`RouteAccess.keys`)."""
    if not keys:
        return
    given = request.headers.get("authorization", "").encode()
    # Every key compared, so the time taken says nothing of which matched.
    if not any([hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]):
        raise AuthenticationError("missing or wrong API key (send 'Authorization: Bearer <key>')")


async def read_json(request: Request, max_bytes: int | None) -> dict[str, Any]:
    """The body as a JSON object, read no further than `max_bytes` (None:
    no limit): a declared or streamed body over it is a 413 before it is
    held in memory or parsed."""
    declared = request.headers.get("content-length", "")
    if max_bytes is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLargeError(f"the request body has {declared} bytes; this server takes at most {max_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if max_bytes is not None and len(body) > max_bytes:
            raise RequestTooLargeError(f"the request body is over {max_bytes} bytes, the most this server takes")
    try:
        data = json.loads(body)
    except RecursionError:
        raise InvalidParameterError("body", "JSON nested too deeply") from None
    except ValueError as e:  # bad JSON or UTF-8, an integer of over 4,300 digits
        raise InvalidParameterError("body", f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidParameterError("body", "must be a JSON object")
    return data


def _reply(result: Reply) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    return StreamingResponse(result, media_type="text/event-stream")


def openai_route(
    body: type[BaseModel] | Callable[[dict[str, Any]], Any] | None = None,
    *,
    public: bool = False,
    before: Callable[[Any], Awaitable[object]] | None = None,
    replica_wide: bool = False,
    movable: bool = False,
    plane: Plane = Plane.API,
) -> Callable[[RouteBody], Handler]:
    """Wrap `route(self[, body])` into a FastAPI method `(self, request)`.

    In order: authorization with the keys the owner's `access` gives the
    route's `plane` (skipped for a `public` route: /health and /metrics,
    which probes and scrapers reach);
    `before(self)`, awaited before the body is read (a route the server
    cannot serve answers so without reading it); the body, at most
    `max_request_bytes` of a JSON object, validated into `body` when it is
    a pydantic model (a 400 names the field) or handed to it when it is a
    function (`dict` takes the object as it is; None: no body is read);
    then the route itself. The handler's `FORWARDED_ATTR` attribute runs
    the same route, less authorization and reading, on a body that the
    router ingress in front read and whose caller it authorized, with
    keyword arguments of the route's own that no client sends (a stream's
    resume point). A `replica_wide` route changes the engine (weights,
    pausing): behind the router ingress every replica answers it. A
    `movable` route's stream can move to another replica: forwarded, the
    route is called with `tracked=True` (its events say how far it came);
    answered directly, nothing could resume it, so it is not tracked.
    """

    def wrap(route: RouteBody) -> Handler:
        async def answer(
            self: Any, read: Callable[[], Awaitable[dict[str, Any]]], route_kwargs: dict[str, Any]
        ) -> Response:
            """The route past authorization: `before`, the body from `read`, the work."""
            try:
                if before is not None:
                    await before(self)
                if body is None:
                    return _reply(await route(self))
                data = await read()
                if isinstance(body, type) and issubclass(body, BaseModel):
                    parsed = parse_request(body, data)
                else:
                    parsed = body(data)
                return _reply(await route(self, parsed, **route_kwargs))
            except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI error body
                return error_response(e)

        # FastAPI reads these annotations when the route is declared, before
        # Serve makes `self` an injected dependency: a class there would be
        # taken for a parameter's type, so `self` is Any.
        async def handler(self: Any, request: Request) -> Response:
            owner: RouteOwner = self
            if not public:
                try:
                    authorize(request, owner.access.keys(plane))
                except Exception as e:  # noqa: BLE001
                    return error_response(e)
            return await answer(self, lambda: read_json(request, owner.max_request_bytes), {})

        async def forwarded(self: Any, data: dict[str, Any] | None, **route_kwargs: Any) -> Response:
            """The route for a body an ingress in front has already read
            (bounded) and whose caller it has authorized."""

            async def given() -> dict[str, Any]:
                if data is None:
                    raise InvalidParameterError("body", "must be a JSON object")
                return data

            if movable:
                route_kwargs = {**route_kwargs, "tracked": True}
            return await answer(self, given, route_kwargs)

        # Not functools.wraps: FastAPI reads the signature through
        # `__wrapped__`, and this handler's is (self, request). Serve's
        # ingress finds a class's routes by their qualified name.
        handler.__name__ = route.__name__
        handler.__qualname__ = route.__qualname__
        handler.__doc__ = route.__doc__
        setattr(handler, FORWARDED_ATTR, forwarded)
        setattr(handler, PUBLIC_ATTR, public)
        setattr(handler, REPLICA_WIDE_ATTR, replica_wide)
        setattr(handler, READS_BODY_ATTR, body is not None)
        setattr(handler, PLANE_ATTR, plane)
        return handler

    return wrap


def served_at(method: str, path: str) -> Callable[[Handler], Handler]:
    """Declare an `openai_route` handler's HTTP method and path; `mount_routes` mounts it."""

    def mark(handler: Handler) -> Handler:
        setattr(handler, HTTP_ATTR, (method, path))
        return handler

    return mark


def mount_routes(app: FastAPI, owner: type, planes: frozenset[Plane]) -> FastAPI:
    """`app` with every route `owner` declares (`served_at`) whose plane is
    in `planes`, in declaration order; a route of another plane is not
    mounted at all (a request for it is one for an unknown path)."""
    for handler in vars(owner).values():
        declared = getattr(handler, HTTP_ATTR, None)
        if declared is not None and getattr(handler, PLANE_ATTR) in planes:
            method, path = declared
            app.add_api_route(path, handler, methods=[method])
    return app
