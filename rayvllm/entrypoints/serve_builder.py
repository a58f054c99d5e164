"""Building the Serve application, and the Python handle on a running one.

`build_app` is what `serve run serve_app:build_app key=value ...`, a Serve
config file and `rayvllm serve` all call: every `EngineArgs` field is an
argument (values may arrive as strings and are coerced), plus the server's
own options below. Without `model` the embedded demo model is served.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import LoggingConfig

from rayvllm.actors.placement import deployment_bundles
from rayvllm.config.engine_args import EngineArgs
from rayvllm.entrypoints.openai.server_args import ServerArgs
from rayvllm.messages.errors import InvalidParameterError

# `serve run <import path>` names its application "default"; the config file does too.
DEFAULT_APP_NAME = "default"
DEMO_MODEL_NAME = "rayvllm-demo"
# The port of `serve run <import path>` (Serve's default). The command has no
# option for it; this variable moves it (the replica answers there, Serve's
# proxy one above), for a machine where 8000 is taken.
SERVE_RUN_PORT = 8000
SERVE_RUN_PORT_ENV = "RAYVLLM_SERVE_RUN_PORT"
# How Serve's proxy sends requests to replicas and takes their answers back:
# "1" over Serve's inter-deployment gRPC (every replica serves it), "0" as Ray
# actor calls whose answers are objects. Read by the proxy at its start.
PROXY_USE_GRPC_ENV = "RAY_SERVE_PROXY_USE_GRPC"


def direct_ingress_env(port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """Environment for a Ray cluster whose ingress replica answers HTTP on
    `port` itself (Ray Serve's direct ingress), so tokens stream to the
    client without the proxy hop: on the 2-core dev box that hop cost a
    quarter of the saturated throughput and doubled TTFT
    (docs/BENCHMARKS.md). The variables must be in the environment of the
    process that starts the cluster: the controller and the replicas read
    them at start. Serve's proxy keeps running on its own port. One port
    means one ingress replica per node, which is this app's shape: the
    LLMServer itself, or with several servers the one router ingress in
    front of them (data parallelism lives inside the engine). Requests that
    still come through the proxy (the port cluster.yaml and the KubeRay
    manifest document) reach the replica over gRPC: each hop's message
    took less than as a Ray object (docs/BENCHMARKS.md, the proxy path)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        # Exclusive bound: exactly `port`.
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        "RAY_SERVE_DEFAULT_HTTP_HOST": host,
        # Serve keeps a stopping direct-ingress replica up at least this
        # long (30 s by default) for an external load balancer to drop it;
        # clients reach this one directly, so only in-flight requests need
        # the wait (drain_timeout_s), and Ctrl-C returns in seconds.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        # Serve holds a released port back from new replicas (150 s by
        # default, for an HAProxy in front to let go of it); with one port
        # and no HAProxy that would keep a replaced replica off the air.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        PROXY_USE_GRPC_ENV: "1",
    }


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """`port` can be bound as Serve's direct-ingress replica binds it (without
    SO_REUSEADDR, which also refuses while a stopped server's connections
    linger in TCP TIME_WAIT, up to a minute)."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_listening(port: int, host: str = "127.0.0.1") -> bool:
    """A server accepts connections on `port`."""
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def wait_for_port(port: int, host: str = "127.0.0.1", timeout_s: float = 90.0) -> bool:
    """Wait until `port_free`; False at once if a server listens there, or
    when `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    told = False
    while not port_free(port, host):
        if port_listening(port, host):
            return False  # a live server, not lingering connections
        if time.monotonic() > deadline:
            return False
        if not told:
            print(f"port {port} is still held by a stopped server's connections (TCP TIME_WAIT, up to a "
                  "minute); waiting for it", file=sys.stderr, flush=True)
            told = True
        time.sleep(0.5)  # the kernel frees the port on its own clock
    return True


# This project's app builders as `serve run` names them: their key=value
# options are checked before `serve run` starts anything.
OUR_BUILDERS = frozenset({"serve_app:build_app", "rayvllm.entrypoints.serve_builder:build_app"})


def start_fast_serve_run(argv: Sequence[str] | None = None, port: int | None = None) -> bool:
    """Put `serve run <import path> [key=value ...]` on the fast path.

    `serve run` of an import path puts Serve's proxy on :8000, and the
    replica answers HTTP itself (direct ingress, a fraction of the proxy
    path's TTFT: docs/BENCHMARKS.md) only where Serve's controller and
    replicas start with the direct-ingress settings. But it imports the app
    before it calls `ray.init`, and then uses the Ray connection and the
    Serve instance it finds. So when this process is that command (its
    options all known, see `serve_run_command`; no direct-ingress setting
    of the user's), connect as it would and start Serve now with those
    settings: on a local cluster it starts, in the cluster's environment;
    on a running one (`--address`, RAY_ADDRESS, a `ray start` here), in
    the job's runtime environment (`join_with_direct_ingress`). The
    replica then answers `port` itself and Serve's proxy moves to
    `port + 1`. `port`: by default `SERVE_RUN_PORT_ENV`'s value, else
    `SERVE_RUN_PORT`. Returns whether it did; otherwise `serve run` goes on
    as it would (proxy on :8000)."""
    argv = sys.argv if argv is None else argv
    if port is None:
        port = int(os.environ.get(SERVE_RUN_PORT_ENV, SERVE_RUN_PORT))
    if len(argv) < 3 or Path(argv[0]).name != "serve" or argv[1] != "run":
        return False
    command = serve_run_command(argv[2:])
    if command is None or Path(command.target).is_file():
        return False  # an unknown option, or a config file (its own proxy and HTTP settings)
    if command.target in OUR_BUILDERS:
        # Refused before a cluster starts, not after (Serve calls the builder last).
        split_args(dict(arg.split("=", 1) for arg in command.app_args if "=" in arg))
    if ray.is_initialized() or any(k.startswith("RAY_SERVE_") and "DIRECT_INGRESS" in k for k in os.environ):
        return False
    runtime_env = command.runtime_env()
    if any("DIRECT_INGRESS" in k for k in runtime_env.get("env_vars", {})):
        return False
    address = command.address if command.address is not None else os.environ.get("RAY_ADDRESS") or None
    if address is not None and address.startswith("ray://"):
        return False  # Ray Client: the driver is not on the cluster
    from ray._private.services import canonicalize_bootstrap_address

    if not wait_for_port(port):
        return False  # taken by a live server: `serve run` reports it
    if address in (None, "local") and canonicalize_bootstrap_address(address) is None:
        # `serve run` would start a local cluster: start it with the settings.
        start_with_direct_ingress(port, address=address, runtime_env=runtime_env)
        return True
    return join_with_direct_ingress(address, port, runtime_env=runtime_env)


def start_with_direct_ingress(
    port: int, host: str = "127.0.0.1", proxy_port: int | None = None, address: str | None = "local",
    runtime_env: dict[str, Any] | None = None,
) -> None:
    """Start a local cluster (`ray.init(address)`) and Serve on it with
    direct ingress on `port` (its proxy on `proxy_port`, by default
    `port + 1`): the settings go in this process's environment, which the
    cluster's processes inherit. This process owns the cluster, so SIGTERM
    then stops it as Ctrl-C does (`drain_on_sigterm`)."""
    os.environ.update(_cluster_env(port, host))
    ray.init(address=address, namespace=SERVE_NAMESPACE, runtime_env=runtime_env or None)
    drain_on_sigterm()
    _start_serve(port, host, proxy_port)


def join_with_direct_ingress(
    address: str | None, port: int, host: str = "127.0.0.1", proxy_port: int | None = None,
    runtime_env: dict[str, Any] | None = None,
) -> bool:
    """Connect to the running cluster at `address` (None: the one `ray.init`
    finds) and start Serve there with direct ingress on `port` (its proxy
    on `proxy_port`, by default `port + 1`), the settings in this job's
    runtime environment (with `runtime_env`'s own): Ray gives a job's
    runtime environment to the actors it creates, Serve's controller among
    them, and they to theirs.
    Where Serve already runs on the cluster it keeps its own settings, so
    this disconnects again and returns False: the caller goes on as Serve
    would (the proxy path, unless the cluster was started with the
    settings)."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME

    runtime_env = dict(runtime_env or {})
    runtime_env["env_vars"] = {**_cluster_env(port, host), **runtime_env.get("env_vars", {})}
    ray.init(address=address, namespace=SERVE_NAMESPACE, runtime_env=runtime_env)
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        _start_serve(port, host, proxy_port)
        return True
    ray.shutdown()
    return False


def _cluster_env(port: int, host: str) -> dict[str, str]:
    """`direct_ingress_env`, with a proxy transport that this process's
    environment sets kept as set."""
    env = direct_ingress_env(port, host)
    if PROXY_USE_GRPC_ENV in os.environ:
        env[PROXY_USE_GRPC_ENV] = os.environ[PROXY_USE_GRPC_ENV]
    return env


def _start_serve(port: int, host: str, proxy_port: int | None) -> None:
    """Serve on the connected cluster, its proxy beside a direct-ingress `port`."""
    serve.start(http_options={"host": host, "port": port + 1 if proxy_port is None else proxy_port})


# `serve run`'s options (as its click command spells them) that take a
# value, by the `ServeRunCommand` field they set (None: not one about the
# cluster), and those that take none.
_SERVE_RUN_VALUE_OPTIONS: dict[str, str | None] = {
    "--app-dir": None, "-d": None, "--route-prefix": None, "--name": None,
    "--address": "address", "-a": "address", "--runtime-env": "runtime_env_file",
    "--runtime-env-json": "runtime_env_json", "--working-dir": "working_dir",
}
_SERVE_RUN_FLAGS = frozenset({"--blocking", "--non-blocking", "--reload", "-r"})


@dataclass(frozen=True)
class ServeRunCommand:
    """What `serve run ARGS` says about the cluster it runs on: its target
    (import path or config file), the address it joins, its runtime
    environment's options."""

    target: str
    app_args: tuple[str, ...] = ()
    address: str | None = None
    runtime_env_file: str | None = None
    runtime_env_json: str | None = None
    working_dir: str | None = None

    def runtime_env(self) -> dict[str, Any]:
        """The runtime environment `serve run` gives its `ray.init` (read by Ray's own parser)."""
        from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args

        return parse_runtime_env_args(
            runtime_env=self.runtime_env_file, runtime_env_json=self.runtime_env_json, working_dir=self.working_dir
        )


def serve_run_command(args: Sequence[str]) -> ServeRunCommand | None:
    """`serve run ARGS` as its click command reads them, or None for an
    option not known here (which might change what `serve run` does) or
    no target."""
    positional: list[str] = []
    values: dict[str, str] = {}
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            positional.append(arg)
            continue
        name, sep, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in _SERVE_RUN_FLAGS and not sep:
            continue
        if name not in _SERVE_RUN_VALUE_OPTIONS:
            return None
        if not sep:
            if not rest:
                return None
            value = rest.pop(0)
        field = _SERVE_RUN_VALUE_OPTIONS[name]
        if field is not None:
            values[field] = value
    return ServeRunCommand(positional[0], tuple(positional[1:]), **values) if positional else None


def drain_on_sigterm() -> None:
    """SIGTERM (what a process manager or Kubernetes sends) shuts down like
    Ctrl-C: `serve run` then stops the app and the cluster it started,
    letting in-flight requests finish (drain_timeout_s), instead of dying
    with them. Call from the main thread of a command that owns its cluster."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def split_args(args: dict[str, Any]) -> tuple[EngineArgs, ServerArgs]:
    """Route each key to the engine or the server, text values converted by
    the field's type; an unknown key is an error naming it (a typo must not
    be silently ignored)."""
    unknown = [k for k in args if k not in EngineArgs.model_fields and k not in ServerArgs.model_fields]
    if unknown:
        raise InvalidParameterError(", ".join(unknown), "not an engine or server argument")
    engine = EngineArgs.from_dict({k: v for k, v in args.items() if k in EngineArgs.model_fields})
    server = ServerArgs.from_dict({k: v for k, v in args.items() if k in ServerArgs.model_fields})
    return engine, server


def build_app(args: dict[str, Any] | None = None) -> Application:
    from rayvllm.entrypoints.autoscaling import serve_autoscaling_config
    from rayvllm.entrypoints.openai.api_server import SERVER_ACTOR_OPTIONS, RoutedLLMServer, llm_server
    from rayvllm.utils.demo import demo_model_path

    engine, server = split_args(dict(args or {}))
    given = engine.model_dump(exclude_unset=True)
    if engine.model is None:
        given["model"] = str(demo_model_path())
        given.setdefault("served_model_name", DEMO_MODEL_NAME)
    # Resolved here: the replica then needs no torch to ask, and its engine
    # goes where its bundles do.
    given["device"] = serve_device(engine)
    options = replica_placement(engine, given["device"])
    options["graceful_shutdown_timeout_s"] = server.drain_timeout_s
    options["health_check_period_s"] = server.health_check_period_s
    if server.autoscaling_config is None:
        options["num_replicas"] = server.num_replicas
    else:
        options["autoscaling_config"], env = serve_autoscaling_config(server.autoscaling_config)
        if env:
            actor = dict(SERVER_ACTOR_OPTIONS)
            runtime_env = dict(actor["runtime_env"])
            runtime_env["env_vars"] = {**runtime_env["env_vars"], **env}
            options["ray_actor_options"] = {**actor, "runtime_env": runtime_env}
    if server.max_replicas > 1 and server.request_router == "kv":
        options["request_router_config"] = kv_router_config(engine, given["model"])
    if server.disable_access_log:
        options["logging_config"] = LoggingConfig(enable_access_log=False)
    if server.max_replicas == 1:
        deployment = llm_server(server.access().planes)
        return deployment.options(**options).bind(given, **server.model_dump())  # type: ignore[attr-defined]
    servers = RoutedLLMServer.options(**options).bind(given, **server.model_dump())  # type: ignore[attr-defined]
    # Several replicas: the router ingress reads each HTTP body once and
    # hands the request router its prompt's tokens (router_ingress.py).
    from rayvllm.entrypoints.openai.router_ingress import OpenAIRouter

    ingress: dict[str, Any] = {
        "graceful_shutdown_timeout_s": server.drain_timeout_s, "health_check_period_s": server.health_check_period_s,
    }
    if server.disable_access_log:
        ingress["logging_config"] = LoggingConfig(enable_access_log=False)
    return OpenAIRouter.options(**ingress).bind(servers, given, **server.model_dump())  # type: ignore[attr-defined]


def kv_router_config(engine: EngineArgs, model: str) -> RequestRouterConfig:
    """The KV-aware router (entrypoints/kv_router.py), with replicas
    reporting their cached blocks every second."""
    from rayvllm.entrypoints.kv_router import KVAwareRequestRouter

    return RequestRouterConfig(
        request_router_class=KVAwareRequestRouter,
        request_router_kwargs={"block_size": engine.block_size, "model": model},
        request_routing_stats_period_s=1.0,
    )


def serve_device(engine: EngineArgs) -> str:
    """The engine's device where a Ray cluster is connected (a Serve config's
    app is built in a task on it; `serve run serve_app:app` connects before
    it imports the app): "cuda" when the cluster has GPUs, which is where
    the replica's bundles can go. Asking Ray spares the build its torch import
    (the largest part of an app's build). Otherwise torch says."""
    if engine.device != "auto" or not ray.is_initialized():
        return engine.resolve_device()
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def replica_placement(engine: EngineArgs, device: str | None = None) -> dict[str, Any]:
    """Serve deployment options that reserve each replica's worker bundles
    (TP x PP ranks per DP rank) with the replica, as Ray Serve LLM does:
    Serve places the replica and its workers together, and removes the group
    with the replica, so a replaced or scaled-down replica leaks nothing."""
    pc = engine.create_parallel_config()
    return {
        "placement_group_bundles": deployment_bundles(pc, device or serve_device(engine)),
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
