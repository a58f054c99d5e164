"""The three ways to start the app answer HTTP: the README's `serve run
serve_app:app` (demo model, no setup) on free ports (serve_harness), the
shipped Serve config file (the shared server is `serve run` of it, with
the other modules' apps added), and `rayvllm serve` on the port it is given."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from rayvllm.actors.niceness import may_lower_niceness
from rayvllm.entrypoints.serve_builder import (
    DEMO_MODEL_NAME, PROXY_USE_GRPC_ENV, SERVE_RUN_PORT_ENV, ServeRunCommand, join_with_direct_ingress,
    serve_run_command,
)

from process_state import descendants_running, start_environment, thread_niceness
from serve_harness import ServeProcess, free_port, held_port, serve_run, shipped_app_url


def _curl_completion(base_url: str) -> dict:
    """Exactly what a user types after the README's first command (plain
    HTTP where the machine has no curl)."""
    data = '{"prompt": "Hello, my name is", "max_tokens": 8}'
    if shutil.which("curl") is None:
        r = requests.post(f"{base_url}/v1/completions", data=data, headers={"Content-Type": "application/json"},
                          timeout=60)
        return r.json()
    out = subprocess.run(
        ["curl", "-sS", f"{base_url}/v1/completions", "-H", "Content-Type: application/json", "-d", data],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(out.stdout)


def _check_demo(base_url: str) -> None:
    body = _curl_completion(base_url)
    assert body["object"] == "text_completion" and body["model"] == DEMO_MODEL_NAME, body
    usage, choice = body["usage"], body["choices"][0]
    assert isinstance(choice["text"], str) and 0 < usage["completion_tokens"] <= 8
    assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 8 else "stop")
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _control_plane_unmounted(base_url: str) -> None:
    """Every route the control plane or runtime LoRA loading would mount
    answers as a path the server does not have, whatever the method."""
    from rayvllm.entrypoints.openai.api_server import server_routes
    from rayvllm.entrypoints.openai.server_args import Plane

    unknown = requests.post(f"{base_url}/no-such-route", json={}, timeout=30)
    assert unknown.status_code == 404
    admin_paths = {path for _, path in server_routes(frozenset(Plane))} - {
        path for _, path in server_routes(frozenset({Plane.API}))
    }
    assert "/init_weight_transfer_engine" in admin_paths and "/v1/load_lora_adapter" in admin_paths
    for path in sorted(admin_paths):
        for method in ("GET", "POST"):
            r = requests.request(method, f"{base_url}{path}", json={}, timeout=30)
            assert (r.status_code, r.json()) == (404, unknown.json()), (method, path)


def _stream_through_sigterm(proc: ServeProcess, url: str, model: str, max_tokens: int) -> None:
    """A long stream is in flight when the server gets SIGTERM: it drains
    (the stream ends with all its tokens and [DONE]), then exits by itself
    with status 0, leaving none of its processes behind."""
    body = {"model": model, "prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            exited = pool.submit(proc.terminate, 120)
            rest = [line for line in lines if line]
            assert exited.result() == 0, proc.log_tail()
    assert rest[-1] == b"data: [DONE]"
    assert json.loads(rest[-2][len(b"data: "):])["usage"]["completion_tokens"] == max_tokens
    # Ray's own processes end right after the command; wait for them.
    deadline = time.monotonic() + 60
    while left := proc.group_pids():
        names = [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left if Path(f"/proc/{pid}").exists()]
        assert time.monotonic() < deadline, f"still running after the server exited: {names}"
        time.sleep(0.2)  # waiting for other processes to exit, not synchronisation


def _start_demo_app(workdir: Path, model: Path) -> ServeProcess:
    return serve_run(["serve_app:app"], workdir / "serve.log")


def _start_cli(workdir: Path, model: Path) -> ServeProcess:
    cli = str(Path(sys.executable).with_name("rayvllm"))
    port, proxy_port = free_port(), free_port()
    return ServeProcess(
        [cli, "serve", "--model", str(model), "--served-model-name", "cli-model", "--max-model-len", "256",
         "--kv-cache-memory-bytes", str(32 << 20), "--disable-access-log", "--port", str(port),
         "--proxy-port", str(proxy_port)],
        workdir / "serve.log", base_url=f"http://127.0.0.1:{port}", ports=(port, proxy_port),
    )


HAS_CLI = Path(sys.executable).with_name("rayvllm").exists()
# Each test's server, by the test's name.
STARTS: dict[str, Callable[[Path, Path], ServeProcess]] = {
    "test_serve_run_demo_app": _start_demo_app,
    "test_rayvllm_serve_cli": _start_cli,
}


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[dict[str, ServeProcess]]:
    """The servers of this module's selected tests, started at once (each
    its own cluster, on its own ports): a start spends half its time
    waiting on its own processes, so side by side they take little longer
    than one alone. Each test stops its own; whatever is left stops here."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    if not HAS_CLI:
        selected.discard("test_rayvllm_serve_cli")
    procs: dict[str, ServeProcess] = {}
    try:
        for name, start in STARTS.items():
            if name in selected:
                procs[name] = start(tmp_path_factory.mktemp(name.removeprefix("test_")), tiny_model_dir)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def test_serve_run_demo_app(servers: dict[str, ServeProcess]) -> None:
    """The README's command takes the fast path: the LLMServer replica
    itself listens on the port (:8000 unless RAYVLLM_SERVE_RUN_PORT says
    otherwise; Serve's direct ingress) and the proxy, one port above,
    serves the same app, fast too. SIGTERM drains it."""
    proc = servers["test_serve_run_demo_app"]
    port, proxy_port = proc.ports
    try:
        proc.wait_ready()
        replicas = proc.descendant_pids("ray::ServeReplica")
        assert len(replicas) == 1 and proc.listener_pids(port) == replicas, proc.log_tail()
        proxied = requests.get(f"http://127.0.0.1:{proxy_port}/v1/models", timeout=60)
        assert proxied.status_code == 200 and proxied.json()["data"][0]["id"] == DEMO_MODEL_NAME
        # What still comes through the proxy reaches the replica over gRPC
        # (the proxy reads the setting from its environment at start), and
        # the replica lowered the proxy from Ray's niceness 15 where the
        # machine lets a process lower its own.
        (proxy,) = proc.descendant_pids("ray::ProxyActor")
        assert start_environment(proxy).get(PROXY_USE_GRPC_ENV) == "1"
        levels = thread_niceness(proxy)
        assert (levels == {0}) == may_lower_niceness(), levels
        _check_demo(f"http://127.0.0.1:{proxy_port}")
        # No key was given, so nothing that changes the server is mounted.
        _control_plane_unmounted(proc.base_url)
        _control_plane_unmounted(f"http://127.0.0.1:{proxy_port}")
        body = _curl_completion(proc.base_url)
        assert body["object"] == "text_completion" and body["model"] == DEMO_MODEL_NAME, body
        # The replica runs no model, so it never loads torch (whose import
        # costs every replica start CPU and memory), not even to serve; nor
        # does the command that built the app (Ray says which device).
        for pid in (replicas[0], proc.proc.pid):
            assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), pid
        _stream_through_sigterm(proc, proc.base_url, DEMO_MODEL_NAME, 400)
    finally:
        proc.stop()


def test_serve_run_config_file(serve_apps: ServeProcess) -> None:
    """A Serve config file takes Serve's proxy: the replicas behind it
    lowered the proxy's threads to niceness 0 (from Ray's 15) where the
    machine lets a process lower its niceness, and left it where it may not."""
    _check_demo(shipped_app_url())
    _control_plane_unmounted(shipped_app_url())
    (proxy,) = serve_apps.descendant_pids("ray::ProxyActor")
    levels = thread_niceness(proxy)
    assert (levels == {0}) == may_lower_niceness(), levels


@pytest.mark.skipif(not HAS_CLI, reason="console script not installed")
def test_rayvllm_serve_cli(servers: dict[str, ServeProcess]) -> None:
    proc = servers["test_rayvllm_serve_cli"]
    url = proc.base_url
    proxy_port = proc.ports[1]
    try:
        proc.wait_ready()
        models = requests.get(f"{url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["cli-model"]
        # Direct ingress: the replica holds --port and Serve's proxy is on --proxy-port.
        assert requests.get(f"http://127.0.0.1:{proxy_port}/v1/models", timeout=10).json() == models
        r = requests.post(f"{url}/v1/completions", json={"model": "cli-model", "prompt": "Hi", "max_tokens": 3},
                          timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        _stream_through_sigterm(proc, url, "cli-model", 240)
    finally:
        proc.stop()


def test_a_control_plane_without_a_key_is_refused_at_start(tmp_path: Path) -> None:
    """`serve run` and `rayvllm serve` with the control plane on and no key
    exit with a message naming the options that would fix it, before any
    cluster starts."""
    proc = serve_run(["serve_app:build_app", "enable_control_plane=true"], tmp_path / "serve.log")
    try:
        assert proc.proc.wait(timeout=180) != 0
        log = proc.log_tail()
        for name in ("enable_control_plane", "admin_api_key", "api_key", "port_is_private"):
            assert name in log, log
        assert "Started a local Ray instance" not in log, log
    finally:
        proc.stop()
    if HAS_CLI:
        cli = str(Path(sys.executable).with_name("rayvllm"))
        out = subprocess.run([cli, "serve", "--enable-control-plane"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0
        assert "enable_control_plane" in out.stderr and "port_is_private" in out.stderr, out.stderr


def test_the_harness_starts_a_server_again_once_after_rays_node_start_timeout(tmp_path: Path) -> None:
    """Ray's node start timing out (a loaded machine) costs one more start,
    not the test; a second such failure, or any other exit, fails it."""
    from serve_harness import RAY_NODE_START_TIMEOUT

    starts = tmp_path / "starts"
    script = (
        f"import pathlib; p = pathlib.Path({str(starts)!r}); p.write_text(p.read_text() + 'x' if p.exists() "
        f"else 'x'); print({RAY_NODE_START_TIMEOUT!r}); raise SystemExit(1)"
    )
    port = held_port()
    proc = ServeProcess([sys.executable, "-c", script], tmp_path / "log", f"http://127.0.0.1:{port}", (port,))
    try:
        with pytest.raises(RuntimeError, match="server exited with 1"):
            proc.wait_ready()
        assert starts.read_text() == "xx"
    finally:
        proc.stop()


def test_build_app_access_log_switch() -> None:
    """`disable_access_log=true` (what `--disable-access-log` passes) turns
    off Serve's per-request log line on the LLMServer deployment; by
    default the deployment keeps Serve's logging as configured."""
    from rayvllm.entrypoints.serve_builder import build_app

    quiet = build_app({"disable_access_log": "true"})._bound_deployment._deployment_config.logging_config
    assert quiet is not None and quiet["enable_access_log"] is False
    assert build_app({})._bound_deployment._deployment_config.logging_config is None


def test_build_app_health_check_period() -> None:
    """`health_check_period_s` is the period of Serve's checks of the
    replicas and of the router ingress in front of several; by default
    Serve's own 10 s."""
    from rayvllm.entrypoints.serve_builder import build_app

    def period(app: object) -> float:
        return app._bound_deployment._deployment_config.health_check_period_s  # type: ignore[attr-defined]

    assert period(build_app({})) == 10.0
    assert period(build_app({"health_check_period_s": "1.5"})) == 1.5
    routed = build_app({"health_check_period_s": 2, "num_replicas": 2})
    assert period(routed) == 2.0
    (replicas,) = routed._bound_deployment.init_args[:1]  # type: ignore[attr-defined]
    assert period(replicas) == 2.0


@pytest.mark.parametrize("gpus,device", [(0, "cpu"), (2, "cuda")])
def test_a_ray_connected_build_takes_the_device_from_the_cluster(
    monkeypatch: pytest.MonkeyPatch, gpus: int, device: str
) -> None:
    """Connected to a cluster (a config's build task, `serve run`'s own
    cluster), `device=auto` is "cuda" exactly when the cluster has GPUs, as
    the replica's bundles then reserve them; an explicit device stands."""
    import ray

    from rayvllm.entrypoints import serve_builder

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})})
    replica = serve_builder.build_app({})._bound_deployment  # type: ignore[attr-defined]
    assert replica.init_args[0]["device"] == device
    bundles = replica._replica_config.placement_group_bundles
    assert any("GPU" in bundle for bundle in bundles) == (device == "cuda"), bundles
    explicit = serve_builder.build_app({"device": "cpu"})._bound_deployment  # type: ignore[attr-defined]
    assert explicit.init_args[0]["device"] == "cpu"


@pytest.mark.parametrize("args,command", [
    (["serve_app:app"], ServeRunCommand("serve_app:app")),
    (["--app-dir", ".", "serve_app:build_app", "model=m"], ServeRunCommand("serve_app:build_app", ("model=m",))),
    (["-d", "src", "--name=x", "serve_app:app", "--non-blocking", "--reload"], ServeRunCommand("serve_app:app")),
    (["serve_config.yaml", "--route-prefix", "/v"], ServeRunCommand("serve_config.yaml")),
    # Options about the cluster: the fast path takes them as `serve run` would.
    (["--address", "local", "serve_app:app"], ServeRunCommand("serve_app:app", address="local")),
    (["-a", "ray://head:10001", "serve_app:app"], ServeRunCommand("serve_app:app", address="ray://head:10001")),
    (["--runtime-env-json", "{}", "serve_app:app"], ServeRunCommand("serve_app:app", runtime_env_json="{}")),
    (["--working-dir=.", "serve_app:app", "--runtime-env", "env.yaml"],
     ServeRunCommand("serve_app:app", working_dir=".", runtime_env_file="env.yaml")),
    # An option not known here might change anything: left to `serve run`.
    (["--unknown", "serve_app:app"], None),
    (["serve_app:app", "--app-dir"], None),
    (["--name", "x"], None),
])
def test_serve_run_options_as_serve_run_reads_them(args: list[str], command: ServeRunCommand | None) -> None:
    """`serve_app` connects and starts Serve with direct ingress before
    `serve run` would, as `serve run` would connect (test_serve_app's
    server runs with `--app-dir` on the fast path); it leaves an unknown
    option to `serve run` itself."""
    assert serve_run_command(args) == command
    if command is not None and command.runtime_env_json is not None:
        assert command.runtime_env() == {}


def test_serve_run_joins_a_running_cluster_on_the_fast_path(
    ray_private: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """On a cluster already running (as from `ray start`; here a
    `ray.cluster_utils.Cluster`), `serve run --address` starts Serve with
    direct ingress: the replica answers the port itself (only a
    direct-ingress replica binds it) and Serve's proxy the port above. A
    process that joins where Serve already runs leaves Serve's settings
    alone (and the app to the proxy path). `rayvllm serve --address` makes
    the same join (test_the_cli_starts_or_joins_its_cluster)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        port = held_port(pair=True)
        serve_cli = str(Path(sys.executable).with_name("serve"))
        proc = ServeProcess(
            [serve_cli, "run", "--address", cluster.address, "serve_app:build_app", f"model={tiny_model_dir}",
             "max_model_len=256", f"kv_cache_memory_bytes={32 << 20}", "served_model_name=joined"],
            tmp_path / "serve-run.log", base_url=f"http://127.0.0.1:{port}", ports=(port, port + 1),
            env={SERVE_RUN_PORT_ENV: str(port)},
        )
        try:
            proc.wait_ready()
            proxied = requests.get(f"http://127.0.0.1:{port + 1}/v1/models", timeout=60)
            assert proxied.status_code == 200 and proxied.json()["data"][0]["id"] == "joined"
            # The settings reached the proxy through the job's runtime environment.
            (raylet,) = cluster.head_node.all_processes["raylet"]
            (proxy,) = descendants_running(raylet.process.pid, "ray::ProxyActor")
            assert start_environment(proxy).get(PROXY_USE_GRPC_ENV) == "1"
            r = requests.post(f"{proc.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert not join_with_direct_ingress(cluster.address, free_port())
            assert not ray.is_initialized()
        finally:
            proc.stop()  # Ctrl-C: `serve run` shuts Serve down on the cluster
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("options,calls", [
    ([], [("start", 9000, "127.0.0.1", None)]),
    (["--address", "10.0.0.2:6379", "--proxy-port", "9005"], [("join", "10.0.0.2:6379", 9000, "127.0.0.1", 9005)]),
    # Serve already runs there with settings of its own: the app goes to its proxy.
    (["--address", "auto"], [("join", "auto", 9000, "127.0.0.1", None), ("init", "auto"), ("serve.start", 9000)]),
    (["--no-direct-ingress"], [("init", None), ("serve.start", 9000)]),
])
def test_the_cli_starts_or_joins_its_cluster(
    monkeypatch: pytest.MonkeyPatch, options: list[str], calls: list[tuple[object, ...]]
) -> None:
    """`rayvllm serve` starts a local cluster with direct ingress, or joins
    `--address` through the same join as `serve run --address` (whose real
    run is test_serve_run_joins_a_running_cluster_on_the_fast_path), and
    then runs the app as the default application, blocking."""
    import ray
    from ray import serve

    from rayvllm.entrypoints import cli, serve_builder

    made: list[tuple[object, ...]] = []
    monkeypatch.setattr(serve_builder, "start_with_direct_ingress", lambda *a: made.append(("start", *a)))
    # A join finds Serve already running on the "auto" cluster.
    monkeypatch.setattr(serve_builder, "join_with_direct_ingress",
                        lambda address, *a: made.append(("join", address, *a)) is None and address != "auto")
    monkeypatch.setattr(ray, "init", lambda address=None: made.append(("init", address)))
    monkeypatch.setattr(serve, "start", lambda http_options: made.append(("serve.start", http_options["port"])))
    runs: list[tuple[str, str, bool]] = []
    monkeypatch.setattr(serve, "run",
                        lambda app, name, route_prefix, blocking: runs.append((name, route_prefix, blocking)))
    assert cli.main(["serve", "--model", "m", "--port", "9000", "--host", "127.0.0.1", *options]) == 0
    assert made == calls
    assert runs == [(serve_builder.DEFAULT_APP_NAME, "/", True)]
