"""Start and stop a real `serve run` (or `rayvllm serve`) in a subprocess
for the integration tests, every one on free ports: `serve run` of an
import path answers on `SERVE_RUN_PORT_ENV`'s port (the replica itself,
Serve's proxy one above, see serve_builder.start_fast_serve_run), and
`rayvllm serve` tests pass `--port`/`--proxy-port`. The HTTP tests that
need no server of their own share one (`SharedServe`): `serve run` of the
shipped serve_config.yaml (on a free port) with their apps added."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import requests
import yaml

from rayvllm.utils.network import free_port

from process_state import descendants_running

REPO = Path(__file__).resolve().parent.parent


def _builder() -> ModuleType:
    """rayvllm's Serve builder (its port helpers), imported on first use:
    it imports Ray, and conftest loads this harness on the GPU proof's
    machine too, which has no Ray and starts no server."""
    from rayvllm.entrypoints import serve_builder

    return serve_builder

START_TIMEOUT_S = 240.0
# What Ray's `ray.init` raises when its new node's raylet did not register in time.
RAY_NODE_START_TIMEOUT = "The current node timed out during startup"

# Ports named at import (a module's server URL) and bound here until their
# server starts: meanwhile no other process is handed one as an ephemeral
# port (a Ray worker's, say, minutes of cluster starts later).
_HELD_PORTS: dict[int, socket.socket] = {}


def held_port(pair: bool = False) -> int:
    """A free port (with `pair`, whose successor is free too), held bound by
    this process until a `ServeProcess` on it starts (it releases them)."""
    while True:
        first = socket.socket()
        port = free_port()  # below the ephemeral range: no outgoing connection takes it once released
        try:
            first.bind(("127.0.0.1", port))
        except OSError:
            first.close()
            continue  # taken since: pick another
        held = [first]
        if pair:
            second = socket.socket()
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                first.close()
                second.close()
                continue  # the successor is taken: pick another pair
            held.append(second)
        for offset, sock in enumerate(held):
            _HELD_PORTS[port + offset] = sock
        return port


def _release_ports(ports: tuple[int, ...]) -> None:
    for port in ports:
        sock = _HELD_PORTS.pop(port, None)
        if sock is not None:
            sock.close()  # bound, never connected: nothing lingers in TIME_WAIT


class ServeProcess:
    """A server process in its own process group. Invariant: after `stop`
    the group is gone, and with it the local Ray cluster `serve run` began."""

    def __init__(self, argv: list[str], log_path: Path, base_url: str, ports: tuple[int, ...],
                 env: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.ports = ports
        _release_ports(ports)
        for port in ports:
            # A replica binds its port without SO_REUSEADDR: a previous
            # server's lingering connections would fail this one's start.
            assert _builder().wait_for_port(port), f"port {port} is taken by a live server"
        # A local cluster of its own: without RAY_ADDRESS, `ray.init` joins
        # the cluster named in /tmp/ray/ray_current_cluster, which any
        # `ray start` or `ray.cluster_utils.Cluster` on the machine writes.
        self._argv, self._env = argv, os.environ | {"RAY_ADDRESS": "local"} | (env or {})
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._restarted = False
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self._argv, cwd=REPO, env=self._env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
            # A runner started in the background ignores SIGINT, and Python
            # then never installs its KeyboardInterrupt handler: `serve run`
            # would not shut down on Ctrl-C.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    def _restart_after_ray_start_timeout(self) -> bool:
        """Once: start the server again when Ray's own node start timed out
        (its raylet has 30 s to register, which two cluster starts side by
        side on a loaded 2-core machine can miss); any other exit stands."""
        if self._restarted or RAY_NODE_START_TIMEOUT not in self.log_tail():
            return False
        self._restarted = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what the failed start left of its cluster
        self.proc.wait()
        self.proc = self._start()
        return True

    def wait_ready(self, headers: dict[str, str] | None = None, base_url: str | None = None) -> None:
        """Until /health answers 200 and the model is listed (at `base_url`,
        by default the server's own); fail with the server's log if it
        exits or the deadline passes."""
        base_url = base_url or self.base_url
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self._restart_after_ray_start_timeout():
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                health = requests.get(f"{base_url}/health", timeout=5)
                models = requests.get(f"{base_url}/v1/models", headers=headers, timeout=5)
                if health.status_code == 200 and models.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)  # polling a server that is still starting, not synchronisation
        raise TimeoutError(f"server not ready in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def descendant_pids(self, cmdline_part: str) -> list[int]:
        """Processes this server started (its Ray cluster's included, at any
        depth) whose command line contains `cmdline_part`: what a fault test
        may kill, by pid, without touching anything else on the machine."""
        return descendants_running(self.proc.pid, cmdline_part)

    def join_env(self) -> dict[str, str]:
        """What a script needs in its environment to join the Ray cluster this
        server started (`address="auto"` could find another cluster on the
        machine): RAY_ADDRESS, read from the cluster's processes, and their
        RAY_AUTH_MODE where set (a cluster `ray.init` starts turns token
        authentication on, and joining by address does not follow it)."""
        for pid in self.descendant_pids("--gcs-address="):
            proc = Path("/proc") / str(pid)
            try:
                args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                env = dict(v.split("=", 1) for v in (proc / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in v)
            except OSError:
                continue  # ended while we looked
            address = next((a.split("=", 1)[1] for a in args if a.startswith("--gcs-address=")), None)
            if address is not None:
                auth = {"RAY_AUTH_MODE": env["RAY_AUTH_MODE"]} if "RAY_AUTH_MODE" in env else {}
                return {"RAY_ADDRESS": address, **auth}
        raise RuntimeError(f"no process of the server names its cluster:\n{self.log_tail()}")

    def group_pids(self) -> list[int]:
        """Live processes of this server's process group (its Ray cluster's
        too), also after the server itself has exited."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                found.append(int(stat.parent.name))
        return found

    def listener_pids(self, port: int) -> list[int]:
        """This server's processes that hold the listening socket of `port`
        (read from /proc: the socket's inode, then each process's fds)."""
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                rows = Path(table).read_text().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                # local address "ADDR:PORT" in hex; state 0A is LISTEN
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    inodes.add(f"socket:[{fields[9]}]")
        found = []
        for pid in self.descendant_pids(""):
            try:
                fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
            except OSError:
                continue  # ended, or not ours to read
            if inodes & set(fds):
                found.append(pid)
        return found

    def log_tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def terminate(self, timeout: float) -> int:
        """SIGTERM, as a process manager stops a server; its exit status
        once it has exited by itself (`stop` still cleans up after it)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """Ctrl-C to the server (it shuts Serve and its local Ray down), a
        kill of its process group if it hangs, then wait until nothing
        listens on its ports any more, so the next server cannot meet this one."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # raylet and GCS share the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()
        deadline = time.monotonic() + 60
        for port in self.ports:
            while _builder().port_listening(port):
                assert time.monotonic() < deadline, f"port {port} still served after the server stopped"
                time.sleep(0.5)  # waiting for another process's socket to close


def _serve() -> str:
    return str(Path(sys.executable).with_name("serve"))


def serve_run(args: list[str], log_path: Path, port: int | None = None) -> ServeProcess:
    """`serve run <import path> [key=value ...]` as the README gives it, on
    `port` (by default a free pair, see `held_port`): the replica
    answers `base_url` itself (Serve's direct ingress) and Serve's proxy
    listens one port above (`ports[1]`)."""
    port = port or held_port(pair=True)
    return ServeProcess([_serve(), "run", *args], log_path, base_url=f"http://127.0.0.1:{port}",
                        ports=(port, port + 1), env={_builder().SERVE_RUN_PORT_ENV: str(port)})


# The shared server: one `serve run` of a config file hosting the apps of
# the HTTP tests that need no server of their own, each app under its own
# route prefix behind Serve's proxy on `SHARED_PORT` (see `SharedServe`).
SHARED_PORT = held_port()
SHARED_CPUS_PER_WORKER = 0.1
SHIPPED_CONFIG = REPO / "serve_config.yaml"


def app_name(module_file: str) -> str:
    """The shared server's app for the test module at `module_file` (and its route prefix)."""
    return Path(module_file).stem.removeprefix("test_")


def shipped_app_url(index: int = 0) -> str:
    """Where the shared server answers the shipped serve_config.yaml's app
    `index` (the route prefix written there)."""
    prefix = yaml.safe_load(SHIPPED_CONFIG.read_text())["applications"][index]["route_prefix"]
    return f"http://127.0.0.1:{SHARED_PORT}{prefix.rstrip('/')}"


def app_url(module_file: str) -> str:
    """Where the shared server answers the test module at `module_file`:
    pass the module's `__file__`; the module defines
    `serve_app_args(request) -> dict`, the `build_app` arguments of its app."""
    return f"http://127.0.0.1:{SHARED_PORT}/{app_name(module_file)}"


class SharedServe:
    """The one `serve run <config file>` that the modules using the
    `serve_apps` fixture share, started on first use: the shipped
    serve_config.yaml (its proxy on `SHARED_PORT`) with every app of `apps`
    added, each under its own route prefix. Invariant: while `proc` is set,
    the shipped apps answer where the file puts them and each app of `apps`
    at `app_url(name)`; `close` stops the server and its cluster."""

    def __init__(self) -> None:
        self.proc: ServeProcess | None = None

    def start(self, apps: dict[str, dict[str, object]], workdir: Path) -> None:
        if self.proc is not None:
            return
        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        config["http_options"]["port"] = SHARED_PORT
        config["applications"] += [
            {"name": name, "route_prefix": f"/{name}", "import_path": "serve_app:build_app",
             # The cluster has the machine's cores as logical CPUs (2 in CI):
             # a fraction of one per engine fits every app beside the shipped one's.
             "args": {"num_cpus_per_worker": SHARED_CPUS_PER_WORKER, **args}}
            for name, args in apps.items()
        ]
        path = workdir / "shared_serve.yaml"
        path.write_text(yaml.safe_dump(config))
        base = f"http://127.0.0.1:{SHARED_PORT}"
        proc = ServeProcess([_serve(), "run", str(path)], workdir / "serve.log", base_url=base, ports=(SHARED_PORT,))
        try:
            for app in config["applications"]:
                proc.wait_ready(base_url=base + app["route_prefix"].rstrip("/"))
        except BaseException:
            proc.stop()
            raise
        self.proc = proc

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
