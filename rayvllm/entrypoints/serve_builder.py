"""Building the Serve application, and the Python handle on a running one.

`build_app` is what `serve run serve_app:build_app key=value ...`, a Serve
config file and `rayvllm serve` all call: every `EngineArgs` field is an
argument (values may arrive as strings and are coerced), plus the server's
own options below. Without `model` the embedded demo model is served.
"""

from __future__ import annotations

from typing import Any

import ray
from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import LoggingConfig

from rayvllm.engine_args import EngineArgs
from rayvllm.errors import InvalidParameterError
from rayvllm.executor.placement import deployment_bundles

# `serve run <import path>` names its application "default"; the config file does too.
DEFAULT_APP_NAME = "default"
DEMO_MODEL_NAME = "rayvllm-demo"


def direct_ingress_env(port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """Environment for a Ray cluster whose LLMServer replica answers HTTP on
    `port` itself (Ray Serve's direct ingress), so tokens stream from the
    replica to the client without the proxy hop: on the 2-core dev box that
    hop cost a quarter of the saturated throughput and doubled TTFT
    (docs/BENCHMARKS.md). The variables must be in the environment of the
    process that starts the cluster: the controller and the replicas read
    them at start. Serve's proxy keeps running on its own port. One port
    means one ingress replica per node, which is this app's shape (data
    parallelism lives inside the engine)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        # Exclusive bound: exactly `port`.
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        "RAY_SERVE_DEFAULT_HTTP_HOST": host,
    }


class ServerArgs(BaseModel):
    """Options of the server itself (not of the engine)."""

    model_config = ConfigDict(extra="forbid")

    api_key: str | None = None
    max_pending_requests: int | None = None
    # Serve's per-request access log line (vLLM: --disable-uvicorn-access-log).
    # Each line costs the replica and Ray's log monitor CPU that a small
    # machine's forward needs.
    disable_access_log: bool = False


def split_args(args: dict[str, Any]) -> tuple[EngineArgs, ServerArgs]:
    """Route each key to the engine or the server; an unknown key is an
    error naming it (a typo must not be silently ignored)."""
    unknown = [k for k in args if k not in EngineArgs.model_fields and k not in ServerArgs.model_fields]
    if unknown:
        raise InvalidParameterError(", ".join(unknown), "not an engine or server argument")
    engine = EngineArgs.from_dict({k: v for k, v in args.items() if k in EngineArgs.model_fields})
    server = ServerArgs(**{k: v for k, v in args.items() if k in ServerArgs.model_fields})
    return engine, server


def build_app(args: dict[str, Any] | None = None) -> Application:
    from rayvllm.demo import demo_model_path
    from rayvllm.entrypoints.openai.api_server import LLMServer

    engine, server = split_args(dict(args or {}))
    given = engine.model_dump(exclude_unset=True)
    if engine.model is None:
        given["model"] = str(demo_model_path())
        given.setdefault("served_model_name", DEMO_MODEL_NAME)
    options = replica_placement(engine)
    if server.disable_access_log:
        options["logging_config"] = LoggingConfig(enable_access_log=False)
    return LLMServer.options(**options).bind(  # type: ignore[attr-defined]
        given,
        api_key=server.api_key,
        max_pending_requests=server.max_pending_requests,
    )


def replica_placement(engine: EngineArgs) -> dict[str, Any]:
    """Serve deployment options that reserve each replica's worker bundles
    (TP x PP ranks per DP rank) with the replica, as Ray Serve LLM does:
    Serve places the replica and its workers together, and removes the group
    with the replica, so a replaced or scaled-down replica leaks nothing."""
    pc = engine.create_parallel_config()
    return {
        "placement_group_bundles": deployment_bundles(pc, engine.resolve_device()),
        "placement_group_strategy": pc.placement_group_strategy,
    }


class _ObjectRefMethod:
    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self._method.remote(*args, **kwargs)._to_object_ref_sync()


class LLMHandle:
    """A handle whose calls return Ray `ObjectRef`s, for plain Ray drivers:
    `ray.get(LLMHandle().generate.remote(prompt, params))` is the finished
    `RequestOutput`. (Serve's own handle returns `DeploymentResponse`s:
    `await` them or call `.result()`.)"""

    def __init__(self, app_name: str = DEFAULT_APP_NAME) -> None:
        self.handle: DeploymentHandle = serve.get_app_handle(app_name)

    @property
    def generate(self) -> _ObjectRefMethod:
        return _ObjectRefMethod(self.handle.generate)
