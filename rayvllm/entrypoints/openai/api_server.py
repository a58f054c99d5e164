"""The `LLMServer` Ray Serve deployment: OpenAI HTTP routes plus Python handle methods.

One replica holds the Processor and the asyncio engine loop (`AsyncLLM`);
the engine core runs in the SchedulerActor with its worker groups (docs/ARCHITECTURE.md),
so the replica itself asks Ray for no CPU. Every route goes through
`http_route.openai_route` (authorization, the bounded body, errors as
OpenAI-style JSON bodies with the status of the `RayvllmError` raised) and
reaches the engine through its `EngineClient` methods only.
"""


import contextlib
import logging
import uuid
from dataclasses import asdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
import ray
from ray import serve
from ray.serve.deployment import Deployment
from ray.serve._private.constants import RAY_SERVE_ENABLE_DIRECT_INGRESS

from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.actors.niceness import lower_serve_proxies
from rayvllm.config.engine_args import EngineArgs
from rayvllm.entrypoints.openai.direct_ingress import bind_direct_ingress_with_reuse_address
from rayvllm.entrypoints.openai.embedding_protocol import EmbeddingRequest
from rayvllm.entrypoints.openai.forwarding import (
    ForwardedChunk, ResponseHead, RouteSpec, StreamPacer, forwarded_routes, response_parts,
)
from rayvllm.entrypoints.openai.http_route import Reply, mount_routes, openai_route, served_at
from rayvllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_tokenize_request,
)
from rayvllm.entrypoints.openai.responses_protocol import ResponsesRequest
from rayvllm.entrypoints.openai.server_args import (
    PENDING_PER_SEQ, Plane, ServerArgs, default_max_pending_prompt_tokens,
)
from rayvllm.entrypoints.openai.serving import OpenAIServing
from rayvllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from rayvllm.entrypoints.openai.serving_models import OpenAIServingModels, parse_lora_modules
from rayvllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from rayvllm.entrypoints.openai.rl_protocol import (
    PauseRequest, SleepRequest, UpdateWeightsRequest, WakeUpRequest, WeightTransferInitRequest,
)
from rayvllm.entrypoints.openai.stream_resume import StreamResume
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import RequestOutput, RequestOutputKind
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.resume import ResumePoint
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.weight_update import WeightUpdateInfo

logger = logging.getLogger(__name__)


def _lora_updated(body: dict[str, Any], done: str) -> Response:
    return Response(f"Success: LoRA adapter '{body['lora_name']}' {done} successfully.", status_code=200)


def _sampling_params(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    return SamplingParams(**params)


# Run the routes and the engine loop on the replica's own event loop
# rather than a second one in another thread: every SSE chunk then reaches
# the socket without a cross-thread hop. With direct ingress this took
# saturated throughput from ~720-760 to ~790 tok/s on the 2-core box
# (docs/BENCHMARKS.md). And run at nice 0, like the engine actors (Ray
# starts workers at 15): at 15 the replica's event loop waited behind the
# forward's threads for every admission and every SSE chunk (p50 TTFT 67 ->
# 25 ms at 2 requests/s, docs/BENCHMARKS.md). The router ingress in front of
# several servers runs the same way, and its handle's request router too
# runs on that one loop: a routed request and each chunk that comes back
# then skip a hop between threads (docs/BENCHMARKS.md, the router's hop).
# The router sends requests over Serve's inter-deployment gRPC, whose
# messages both ends cap at 4 MiB unless told otherwise: a body up to
# `max_request_bytes` and a whole answer must pass.
SERVER_ACTOR_OPTIONS: dict[str, Any] = {
    "num_cpus": 0,
    "runtime_env": {"env_vars": {
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1), "RAY_worker_niceness": "0",
    }},
}

# Serve finds a dead replica (a killed process, an engine that failed for
# good) at its next health check (`health_check_period_s`, a server option).
# A slow answer is not a dead engine: a long step or a weight load may hold
# it, hence the long timeout.
REPLICA_HEALTH_CHECK: dict[str, Any] = {
    "health_check_period_s": ServerArgs.model_fields["health_check_period_s"].default,
    "health_check_timeout_s": 60,
}


class LLMServerImpl:
    """Invariant: one `AsyncLLM` per replica, started with the replica and
    shut down with it; every route and handle method goes through it."""

    def __init__(self, engine_args: dict[str, Any], **server_args: Any) -> None:
        """`server_args`: `ServerArgs` fields; an unset one takes its default there."""
        bind_direct_ingress_with_reuse_address()
        server = ServerArgs.from_dict(server_args)
        max_pending_requests = server.max_pending_requests
        max_pending_prompt_tokens = server.max_pending_prompt_tokens
        args = EngineArgs.from_dict(engine_args)
        if args.distributed_executor_backend is None:
            # The replica keeps the loop; the core lives in the SchedulerActor.
            args.distributed_executor_backend = "ray"
        if not RAY_SERVE_ENABLE_DIRECT_INGRESS and args.cpu_reserved_cores is None:
            # Every token then crosses Serve's proxy as well as this replica:
            # with every core computing, those hops wait for a core each
            # (docs/BENCHMARKS.md, the proxy path).
            args.cpu_reserved_cores = 1
        # At Ray's niceness (15) the proxy waits behind every process at 0,
        # with or without direct ingress (whose clusters still document the
        # proxy's port).
        lower_serve_proxies()
        config = args.create_engine_config()
        if max_pending_requests is None:
            max_pending_requests = PENDING_PER_SEQ * config.scheduler_config.max_num_seqs
        if max_pending_prompt_tokens is None:
            max_pending_prompt_tokens = default_max_pending_prompt_tokens(
                config.scheduler_config.max_num_batched_tokens, config.model_config.max_model_len
            )
        # Serve reserved the workers' bundles with this replica (build_app).
        self.engine = async_llm_from_engine_args(
            config, max_pending_requests=max_pending_requests, max_pending_prompt_tokens=max_pending_prompt_tokens,
            reserved_pg=ray.util.get_current_placement_group(),
            step_timeout_s=server.step_timeout_s,
        )
        serving_args = ([self.engine.served_model_name], self.engine.max_model_len)
        self.models = OpenAIServingModels(
            *serving_args, root=self.engine.model_path, lora_modules=parse_lora_modules(server.lora_modules),
            check_lora=self.engine.check_lora,
        )
        self.serving = OpenAIServing(
            self.engine, *serving_args, trust_request_chat_template=server.trust_request_chat_template,
            enable_auto_tool_choice=server.enable_auto_tool_choice, tool_call_parser=server.tool_call_parser,
            models=self.models,
        )
        self.embedding = OpenAIServingEmbedding(self.engine, *serving_args, models=self.models)
        self.responses = OpenAIServingResponses(self.engine, *serving_args, models=self.models)
        self._multiplexed_lora = None
        if config.lora_config is not None:
            # Serve model multiplexing: a replica reports the adapters it
            # served lately, and Serve routes requests that name one (the
            # `serve_multiplexed_model_id` header, or a handle's
            # `multiplexed_model_id`) to a replica that has it.
            models = self.models

            async def lora_for(model_id: str) -> LoRARequest | None:
                return models.resolve(model_id)[1]

            self._multiplexed_lora = serve.multiplexed(
                max_num_models_per_replica=config.lora_config.max_cpu_loras
            )(lora_for)
        self.access = server.access()
        # What `serve_http` answers behind the router ingress: the routes
        # this server mounts, and no others.
        self.routes = server_routes(self.access.planes)
        warning = server.open_planes_warning()
        if warning is not None:
            logger.warning(warning)
        self.max_request_bytes = server.max_request_bytes
        self._pacer = StreamPacer()

    async def _multiplexed_adapter(self) -> LoRARequest | None:
        """The adapter Serve routed this request for (None: none named),
        recorded as this replica's, so that Serve sends it more of them."""
        model_id = serve.get_multiplexed_model_id()
        if not model_id or self._multiplexed_lora is None:
            return None
        return await self._multiplexed_lora(model_id)

    async def _require_pooling(self) -> None:
        """A model that does not pool says so before an embedding body is read."""
        self.engine.check_runner(PoolingParams())
        await self._multiplexed_adapter()

    # ---- OpenAI routes --------------------------------------------------------------

    @served_at("POST", "/v1/completions")
    @openai_route(CompletionRequest, before=_multiplexed_adapter, movable=True)
    async def completions(
        self, body: CompletionRequest, resume: StreamResume | None = None, tracked: bool = False
    ) -> Reply:
        return await self.serving.create_completion(body, f"cmpl-{uuid.uuid4().hex}", resume, tracked)

    @served_at("POST", "/v1/chat/completions")
    @openai_route(ChatCompletionRequest, before=_multiplexed_adapter, movable=True)
    async def chat_completions(
        self, body: ChatCompletionRequest, resume: StreamResume | None = None, tracked: bool = False
    ) -> Reply:
        return await self.serving.create_chat_completion(body, f"chatcmpl-{uuid.uuid4().hex}", resume, tracked)

    @served_at("POST", "/v1/responses")
    @openai_route(ResponsesRequest, before=_multiplexed_adapter)
    async def create_response(self, body: ResponsesRequest) -> Reply:
        return await self.responses.create_response(body, f"resp_{uuid.uuid4().hex}")

    @served_at("POST", "/v1/embeddings")
    @openai_route(EmbeddingRequest, before=_require_pooling)
    async def embeddings(self, body: EmbeddingRequest) -> Reply:
        return await self.embedding.create_embedding(body, f"embd-{uuid.uuid4().hex}")

    @served_at("GET", "/v1/models")
    @openai_route()
    async def models(self) -> Reply:
        return self.serving.show_models()

    @served_at("POST", "/v1/load_lora_adapter")
    @openai_route(dict, plane=Plane.ADAPTERS)
    async def load_lora_adapter(self, body: dict[str, Any]) -> Reply:
        """vLLM's route: {"lora_name", "lora_path"} becomes a served model
        (on this replica: the one that answers)."""
        self.models.load_lora_adapter(body.get("lora_name"), body.get("lora_path"))
        return _lora_updated(body, "added")

    @served_at("POST", "/v1/unload_lora_adapter")
    @openai_route(dict, plane=Plane.ADAPTERS)
    async def unload_lora_adapter(self, body: dict[str, Any]) -> Reply:
        """vLLM's route: {"lora_name"} is served no more; admitted requests finish with it."""
        self.models.unload_lora_adapter(body.get("lora_name"))
        return _lora_updated(body, "removed")

    @served_at("POST", "/tokenize")
    @openai_route(parse_tokenize_request)
    async def tokenize(self, body: TokenizeRequest) -> Reply:
        return await self.serving.tokenize(body)

    @served_at("POST", "/detokenize")
    @openai_route(DetokenizeRequest)
    async def detokenize(self, body: DetokenizeRequest) -> Reply:
        return self.serving.detokenize(body)

    @served_at("GET", "/health")
    @openai_route(public=True)
    async def health(self) -> Reply:
        await self.engine.check_health()
        return Response(status_code=200)

    @served_at("GET", "/metrics")
    @openai_route(public=True)
    async def metrics(self) -> Reply:
        payload, content_type = await self.engine.render_metrics()
        return Response(payload, media_type=content_type)

    # ---- the control plane for RL loops (docs/RL.md): mounted by enable_control_plane --

    @served_at("POST", "/reset_prefix_cache")
    @openai_route(replica_wide=True, plane=Plane.CONTROL)
    async def reset_prefix_cache_route(self) -> Reply:
        return JSONResponse({"reset": await self.engine.reset_prefix_cache()})

    @served_at("POST", "/pause")
    @openai_route(PauseRequest, replica_wide=True, plane=Plane.CONTROL)
    async def pause_route(self, body: PauseRequest) -> Reply:
        await self.engine.pause_generation(body.mode, body.clear_cache)
        return Response(status_code=200)

    @served_at("POST", "/resume")
    @openai_route(replica_wide=True, plane=Plane.CONTROL)
    async def resume_route(self) -> Reply:
        await self.engine.resume_generation()
        return Response(status_code=200)

    @served_at("GET", "/is_paused")
    @openai_route(plane=Plane.CONTROL)
    async def is_paused_route(self) -> Reply:
        return JSONResponse({"is_paused": self.engine.is_paused()})

    @served_at("POST", "/init_weight_transfer_engine")
    @openai_route(WeightTransferInitRequest, replica_wide=True, plane=Plane.CONTROL)
    async def init_weight_transfer_engine_route(self, body: WeightTransferInitRequest) -> Reply:
        await self.engine.init_weight_transfer_engine(**body.init_info.model_dump(exclude_none=True))
        return Response(status_code=200)

    @served_at("POST", "/start_weight_update")
    @openai_route(replica_wide=True, plane=Plane.CONTROL)
    async def start_weight_update_route(self) -> Reply:
        await self.engine.start_weight_update()
        return Response(status_code=200)

    @served_at("POST", "/update_weights")
    @openai_route(UpdateWeightsRequest, replica_wide=True, plane=Plane.CONTROL)
    async def update_weights_route(self, body: UpdateWeightsRequest) -> Reply:
        await self.engine.update_weights(WeightUpdateInfo(**body.update_info.model_dump()))
        return Response(status_code=200)

    @served_at("POST", "/finish_weight_update")
    @openai_route(replica_wide=True, plane=Plane.CONTROL)
    async def finish_weight_update_route(self) -> Reply:
        await self.engine.finish_weight_update()
        return Response(status_code=200)

    @served_at("POST", "/sleep")
    @openai_route(SleepRequest, replica_wide=True, plane=Plane.CONTROL)
    async def sleep_route(self, body: SleepRequest) -> Reply:
        await self.engine.sleep(body.level)
        return Response(status_code=200)

    @served_at("POST", "/wake_up")
    @openai_route(WakeUpRequest, replica_wide=True, plane=Plane.CONTROL)
    async def wake_up_route(self, body: WakeUpRequest) -> Reply:
        await self.engine.wake_up(body.tags)
        return Response(status_code=200)

    @served_at("GET", "/is_sleeping")
    @openai_route(plane=Plane.CONTROL)
    async def is_sleeping_route(self) -> Reply:
        return JSONResponse({"is_sleeping": self.engine.is_sleeping()})

    # ---- Python handle methods ------------------------------------------------------

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return await self.engine.collective_rpc(method, args, kwargs)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine.reset_prefix_cache()

    async def init_weight_transfer_engine(self, backend: str, **init_info: Any) -> None:
        await self.engine.init_weight_transfer_engine(backend, **init_info)

    async def start_weight_update(self) -> None:
        await self.engine.start_weight_update()

    async def update_weights(
        self, update_info: WeightUpdateInfo | dict[str, Any] | None = None, weights: Any = None
    ) -> None:
        await self.engine.update_weights(update_info, weights)

    async def finish_weight_update(self) -> None:
        await self.engine.finish_weight_update()

    async def sync_weights(self, weights: Any, backend: str = "ray") -> None:
        """`weights`: a dict, or (best: the trainer puts once) an object ref
        to one; `gloo` broadcasts from this replica's process."""
        await self.engine.sync_weights(weights, backend)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        await self.engine.pause_generation(mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.engine.resume_generation()

    def is_paused(self) -> bool:
        return self.engine.is_paused()

    async def sleep(self, level: int = 1) -> None:
        await self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        session_id: str | None = None,
    ) -> RequestOutput:
        """The finished `RequestOutput` (as `LLM.generate` returns it).
        Without `lora_request`, a handle's `multiplexed_model_id` that names
        a served adapter picks it. `session_id`: requests of one session go
        to one replica while it is not overloaded (the KV-aware router reads
        it; the replica itself ignores it)."""
        final: RequestOutput | None = None
        async for out in self.engine.generate(
            prompt, _sampling_params(sampling_params), request_id or uuid.uuid4().hex,
            output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora_request or await self._multiplexed_adapter(),
            final_only=True,
        ):
            final = out
        assert final is not None and final.finished
        return final

    async def generate_stream(
        self,
        prompt: Any,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        session_id: str | None = None,
        resume: ResumePoint | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """DELTA `RequestOutput`s as tokens arrive; call through
        `handle.options(stream=True)`; the adapter and session as in
        `generate`. `resume`: continue, after what its caller has, a stream
        (n=1) that a replica now dead began (the router ingress sends it)."""
        async for out in self.engine.generate(
            prompt, _sampling_params(sampling_params), request_id or uuid.uuid4().hex,
            lora_request=lora_request or await self._multiplexed_adapter(), resume=resume,
        ):
            yield out

    async def serve_http(
        self,
        method: str,
        path: str,
        data: dict[str, Any] | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        session_id: str | None = None,
        resume: StreamResume | None = None,
    ) -> AsyncIterator[ResponseHead | ForwardedChunk | str | bytes]:
        """The HTTP route `method path` on `data`, for the router ingress in
        front of several replicas (router_ingress.py), which read the body
        and checked the caller's key: a `ResponseHead`, then a stream's
        chunks. `prompt_token_ids` and `session_id` are the KV-aware
        router's hints; the replica itself ignores them. `resume`: the
        stream (of a completion or chat route) continues from there, after
        its replica died."""
        spec = self.routes.get((method, path))
        route_kwargs = {"resume": resume} if resume is not None else {}
        response = (
            await spec.forwarded(self, data, **route_kwargs)
            if spec is not None
            else JSONResponse({"detail": "Not Found"}, 404)
        )
        async for part in response_parts(response, self._pacer):
            yield part

    async def serve_http_whole(self, method: str, path: str, data: dict[str, Any] | None = None) -> ResponseHead:
        """`serve_http` for a route that answers in one piece (the router
        ingress sends a replica-wide route to every replica this way)."""
        async with contextlib.aclosing(self.serve_http(method, path, data)) as parts:
            head = await anext(parts)
        assert isinstance(head, ResponseHead) and head.body is not None, "a replica-wide route does not stream"
        return head

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing-stats hook: the load and cached blocks the
        KV-aware request router (entrypoints/kv_router.py) ranks replicas by."""
        return self.engine.routing_report()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling-stats hook: the engine's load, which the
        engine-signal autoscaling policy (entrypoints/autoscaling.py) scales by."""
        return {k: float(v) for k, v in asdict(self.engine.load()).items()}

    async def check_health(self) -> None:
        """Serve's replica health hook: a failing engine gets the replica
        restarted. An engine replacing a failed core is not failing: its
        requests wait for the new core, and a new replica would lose them
        (a restart that takes longer than Serve's few missed checks, as a
        large model's load or a busy machine's does, would otherwise end the
        replica it was saving)."""
        await self.engine.check_health(allow_restarting=True)

    def __del__(self) -> None:
        serving = getattr(self, "serving", None)
        if serving is not None:
            serving.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


# The deployment's options, the same whether it answers HTTP itself or
# behind the router ingress.
SERVER_DEPLOYMENT: dict[str, Any] = {
    "name": "LLMServer",
    "ray_actor_options": SERVER_ACTOR_OPTIONS,
    # Each request is a long-lived coroutine; admission is the engine's
    # call (max_pending_requests), not a small Serve default.
    "max_ongoing_requests": 4096,
    **REPLICA_HEALTH_CHECK,
}


def server_app(planes: frozenset[Plane]) -> FastAPI:
    """The server's FastAPI app: the routes of `planes` (`ServerArgs.access`), no others."""
    app = FastAPI(title="rayvllm", description="OpenAI-compatible API served by rayvllm")
    return mount_routes(app, LLMServerImpl, planes)


def server_routes(planes: frozenset[Plane]) -> dict[tuple[str, str], RouteSpec]:
    """(method, path) -> route, for the routes of `planes`."""
    return forwarded_routes(server_app(planes), LLMServerImpl)


def llm_server(planes: frozenset[Plane]) -> Deployment:
    """The deployment of one replica that answers HTTP itself (FastAPI
    ingress), with the routes of `planes` mounted: bind it with the
    server options that give those planes (`ServerArgs.access`); a plane
    the options turn on and the app lacks answers 404."""
    return serve.deployment(**SERVER_DEPLOYMENT)(serve.ingress(server_app(planes))(LLMServerImpl))


# One replica with the API alone (the default options).
LLMServer = llm_server(ServerArgs().access().planes)
# Several sit behind the router ingress (router_ingress.py; Serve allows one
# FastAPI ingress per app), which reaches their routes through `serve_http`.
RoutedLLMServer = serve.deployment(**SERVER_DEPLOYMENT)(LLMServerImpl)
