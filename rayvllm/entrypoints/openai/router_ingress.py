"""`OpenAIRouter`: the ingress deployment in front of several `LLMServer`
replicas (build_app puts it there when `num_replicas` > 1).

Serve's HTTP proxy hands an ingress replica the raw request, so a request
router placed on the servers themselves would see no prompt. This thin
replica reads the body once (bounded, after the API key), works out the
routing hints (the prompt's exact token ids, the session: routing_hints.py)
and calls one server through a handle, where the KV-aware router
(entrypoints/kv_router.py) picks the replica holding the longest cached
prefix. The server answers the route as it would have itself
(`LLMServer.serve_http`) and the answer comes back in parts
(forwarding.py): one head, then a stream's chunks as they are made.
When a server dies mid-stream, the stream moves: another server continues
it from the tokens and text the client has (stream_resume.py), so the
client reads one unbroken stream. Routes that change the engine (weight
updates, pausing: `replica_wide`) go to every replica, as do the matching
handle calls (`sync_weights`, `pause_generation`, ...): all replicas serve
one policy. Python handle calls (`generate`, `generate_stream`) pass
through to the replica the router picks. It holds no engine and asks Ray
for no CPU.
"""

# No `from __future__ import annotations`: FastAPI reads the routes'
# annotations as types when they are declared.
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from rayvllm.config.engine_args import EngineArgs
from rayvllm.entrypoints.openai.api_server import REPLICA_HEALTH_CHECK, SERVER_ACTOR_OPTIONS, server_routes
from rayvllm.entrypoints.openai.direct_ingress import bind_direct_ingress_with_reuse_address
from rayvllm.entrypoints.openai.forwarding import ForwardedChunk, ResponseHead
from rayvllm.entrypoints.openai.http_route import authorize, error_response, read_json
from rayvllm.entrypoints.openai.routing_hints import routing_hints
from rayvllm.entrypoints.openai.server_args import ServerArgs
from rayvllm.entrypoints.openai.stream_resume import StreamResume
from rayvllm.entrypoints.openai.streams import SSE_DONE, sse_error
from rayvllm.messages.errors import EngineDeadError
from rayvllm.messages.outputs import RequestOutput
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)
app = FastAPI(title="rayvllm", description="OpenAI-compatible API served by rayvllm (several replicas)")
# Multiplexed adapters: Serve's header, read by the proxy for its own
# routing, and passed on to the server's handle call here.
MULTIPLEX_HEADER = "serve_multiplexed_model_id"


Reissue = Callable[[StreamResume], DeploymentResponseGenerator]


async def _relay(
    parts: DeploymentResponseGenerator, resume: StreamResume | None, reissue: Reissue, limit: int
) -> AsyncIterator[str | bytes]:
    """A stream's chunks; a client that leaves cancels the server's stream
    (which ends its requests there). When its server dies, a resumable
    stream (`resume` set: where it started) is asked of a server again,
    from where its client stands, up to `limit` times; Serve's router no
    longer picks the dead one. Any other failure, or one past the limit,
    ends the stream as a failing engine does: an in-band error event, then
    [DONE]."""
    moves = 0
    awaiting_head = False
    try:
        while True:
            try:
                if awaiting_head:
                    head = await parts.__anext__()
                    awaiting_head = False
                    if head.body is not None:  # the new server answered with an error
                        yield b"data: " + head.body + b"\n\n"
                        yield SSE_DONE
                        return
                async for part in parts:
                    if isinstance(part, ForwardedChunk):
                        assert resume is not None
                        resume.advance(part.token_ids, part.text_chars, part.num_cached_tokens, part.finished)
                        yield part.data
                    else:
                        yield part
                return
            except (RayActorError, ActorUnavailableError) as e:
                if resume is None or resume.finished or moves >= limit:
                    raise
                moves += 1
                logger.warning("a forwarded stream's server died (%s); it moves to another (%d of %d)", e, moves, limit)
                parts.cancel()
                parts = reissue(resume)
                awaiting_head = True
    except RayError as e:
        logger.warning("a forwarded stream's server failed: %s", e)
        yield sse_error(EngineDeadError(str(e)))
        yield SSE_DONE
    finally:
        parts.cancel()


@serve.deployment(
    name="OpenAIRouter", ray_actor_options=SERVER_ACTOR_OPTIONS, max_ongoing_requests=4096, **REPLICA_HEALTH_CHECK
)
@serve.ingress(app)
class OpenAIRouter:
    """Invariant: every request reaches exactly one `LLMServer` replica, in
    one handle call; nothing here holds engine state."""

    def __init__(self, server: DeploymentHandle, engine_args: dict[str, Any], **server_args: Any) -> None:
        bind_direct_ingress_with_reuse_address()
        args = ServerArgs.from_dict(server_args)
        self.access = args.access()
        # The servers' routes that these options mount; the others are unknown paths here too.
        self.routes = server_routes(self.access.planes)
        warning = args.open_planes_warning()
        if warning is not None:
            logger.warning(warning)
        self.max_request_bytes = args.max_request_bytes
        self.stream_migration_limit = args.stream_migration_limit
        self._server = server
        model_config = EngineArgs.from_dict(engine_args).create_engine_config().model_config
        self._served_model_name = model_config.served_model_name
        self._tokenizer = get_tokenizer(model_config.tokenizer)

    def _handle(self, multiplexed_model_id: str) -> DeploymentHandle:
        if multiplexed_model_id:
            return self._server.options(multiplexed_model_id=multiplexed_model_id)
        return self._server

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, path: str, request: Request) -> Response:
        path = "/" + path  # below the app's route prefix, as the server's routes are declared
        spec = self.routes.get((request.method, path))
        if spec is None:
            methods = sorted(m for m, p in self.routes if p == path)
            if methods:
                return JSONResponse({"detail": "Method Not Allowed"}, 405, headers={"Allow": ", ".join(methods)})
            return JSONResponse({"detail": "Not Found"}, 404)
        try:
            if not spec.public:
                authorize(request, self.access.keys(spec.plane))
            data = await read_json(request, self.max_request_bytes) if spec.reads_body else None
        except Exception as e:  # noqa: BLE001 - answered as the server would
            return error_response(e)
        if spec.replica_wide:
            return await self._answer_everywhere(request.method, path, data)
        hints = routing_hints(path, data, request.headers, self._tokenizer, self._served_model_name)
        # Over Serve's inter-deployment gRPC (every replica serves it) rather
        # than a Ray actor call whose chunks come back as objects, and
        # pickled without cloudpickle's Python-level pickler (a JSON body,
        # hints and the parts are plain data): the hop's dispatch, head and
        # chunks each took a few ms less (docs/BENCHMARKS.md).
        handle = self._handle(request.headers.get(MULTIPLEX_HEADER, "")).options(
            stream=True, _by_reference=False, request_serialization="pickle", response_serialization="pickle"
        )

        def call(resume: StreamResume | None = None) -> DeploymentResponseGenerator:
            return handle.serve_http.remote(request.method, path, data, resume=resume, **hints.as_kwargs())

        parts = call()
        try:
            head = await parts.__anext__()
        except RayError as e:  # the server died before it answered
            logger.warning("a forwarded request's server failed: %s", e)
            return error_response(EngineDeadError(str(e)))
        assert isinstance(head, ResponseHead)
        if head.body is not None:
            return Response(head.body, head.status, headers=dict(head.headers))
        relay = _relay(parts, head.resume, call, self.stream_migration_limit)
        return StreamingResponse(relay, head.status, headers=dict(head.headers))

    async def _answer_everywhere(self, method: str, path: str, data: dict[str, Any] | None) -> Response:
        """A replica-wide route, answered by every replica: the first
        failure's answer if any replica failed, else the first answer."""
        heads: list[ResponseHead] = await self._server.broadcast(
            "serve_http_whole", method, path, data
        ).results_async()
        if not heads:
            return error_response(EngineDeadError("no replica is running"))
        head = next((h for h in heads if h.status >= 400), heads[0])
        assert head.body is not None
        return Response(head.body, head.status, headers=dict(head.headers))

    async def _everywhere(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Handle method `method` on every replica; the first replica's
        result (an error on any replica raises)."""
        results = await self._server.broadcast(method, *args, **kwargs).results_async()
        if not results:
            raise EngineDeadError("no replica is running")
        return results[0]

    # The RL control plane (docs/RL.md) on every replica. A `gloo` or
    # `nccl` group is one engine's: with several replicas, sync by `ray`.
    async def sync_weights(self, weights: Any, backend: str = "ray") -> None:
        await self._everywhere("sync_weights", weights, backend)

    async def init_weight_transfer_engine(self, backend: str, **init_info: Any) -> None:
        await self._everywhere("init_weight_transfer_engine", backend, **init_info)

    async def start_weight_update(self) -> None:
        await self._everywhere("start_weight_update")

    async def update_weights(self, update_info: Any = None, weights: Any = None) -> None:
        await self._everywhere("update_weights", update_info, weights)

    async def finish_weight_update(self) -> None:
        await self._everywhere("finish_weight_update")

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._everywhere("reset_prefix_cache"))

    async def collective_rpc(
        self, method: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Every replica's workers' results, one list per replica."""
        return await self._server.broadcast("collective_rpc", method, args, kwargs).results_async()

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        await self._everywhere("pause_generation", mode, clear_cache)

    async def resume_generation(self) -> None:
        await self._everywhere("resume_generation")

    async def is_paused(self) -> bool:
        return all(await self._server.broadcast("is_paused").results_async())

    async def sleep(self, level: int = 1) -> None:
        await self._everywhere("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._everywhere("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return all(await self._server.broadcast("is_sleeping").results_async())

    async def generate(self, *args: Any, **kwargs: Any) -> RequestOutput:
        """`LLMServer.generate`, its arguments as they are, on the replica the router picks."""
        return await self._handle(serve.get_multiplexed_model_id()).generate.remote(*args, **kwargs)

    async def generate_stream(
        self, prompt: Any, sampling_params: SamplingParams | dict[str, Any] | None = None, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """`LLMServer.generate_stream` on the replica the router picks; a
        stream of one sequence whose replica dies moves to another, from
        the tokens and text already yielded (as HTTP streams do)."""
        handle = self._handle(serve.get_multiplexed_model_id()).options(stream=True)
        n = sampling_params.get("n", 1) if isinstance(sampling_params, dict) else getattr(sampling_params, "n", 1)
        resume = StreamResume("", 0) if n == 1 else None
        moves = 0
        while True:
            point = resume.point() if resume is not None and moves else None
            try:
                async for out in handle.generate_stream.remote(prompt, sampling_params, resume=point, **kwargs):
                    if resume is not None:
                        (seq,) = out.outputs
                        text_chars = resume.text_chars + len(seq.text)
                        resume.advance(tuple(seq.token_ids), text_chars, 0, seq.finish_reason is not None)
                    yield out
                return
            except (RayActorError, ActorUnavailableError) as e:
                if resume is None or resume.finished or moves >= self.stream_migration_limit:
                    raise
                moves += 1
                logger.warning("a handle stream's server died (%s); it moves to another (%d of %d)", e, moves,
                               self.stream_migration_limit)
