"""Start and stop a real `serve run` (or `rayvllm serve`) in a subprocess
for the integration tests. `serve run` of an import path has no port
option: the app answers on :8000 (the replica itself, Serve's proxy moved
to :8001, see serve_builder.start_fast_serve_run; a config file puts the
proxy there), so the tests of the README's own commands use those ports,
waiting while a previous server's connections still hold them. Every other
port is picked free per test run: with `DIRECT_ENV` the replica answers
straight on `DIRECT_PORT`, and `rayvllm serve` tests pass free
`--port`/`--proxy-port`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests

from rayvllm.entrypoints.serve_builder import SERVE_RUN_PORT, direct_ingress_env, port_listening, wait_for_port
from rayvllm.worker.worker import free_port

REPO = Path(__file__).resolve().parent.parent
README_PORTS = (SERVE_RUN_PORT, SERVE_RUN_PORT + 1)
BASE_URL = f"http://127.0.0.1:{SERVE_RUN_PORT}"


DIRECT_PORT = free_port()
DIRECT_URL = f"http://127.0.0.1:{DIRECT_PORT}"
DIRECT_ENV = direct_ingress_env(DIRECT_PORT)
START_TIMEOUT_S = 240.0


class ServeProcess:
    """A server process in its own process group. Invariant: after `stop`
    the group is gone, and with it the local Ray cluster `serve run` began."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 base_url: str = BASE_URL, ports: tuple[int, ...] = README_PORTS) -> None:
        self.base_url = base_url
        self.ports = ports
        for port in ports:
            # A replica binds its port without SO_REUSEADDR: a previous
            # server's lingering connections would fail this one's start.
            assert wait_for_port(port), f"port {port} is taken by a live server"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env or {})
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            # A runner started in the background ignores SIGINT, and Python
            # then never installs its KeyboardInterrupt handler: `serve run`
            # would not shut down on Ctrl-C.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    def wait_ready(self, headers: dict[str, str] | None = None) -> None:
        """Until /health answers 200 and the model is listed; fail with the
        server's log if it exits or the deadline passes."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                health = requests.get(f"{self.base_url}/health", timeout=5)
                models = requests.get(f"{self.base_url}/v1/models", headers=headers, timeout=5)
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
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # The command name in parentheses may hold spaces: split after it.
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # the process ended while we looked
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found, todo = [], list(children.get(self.proc.pid, []))
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
            except OSError:
                continue
            cmdline = raw.replace(b"\0", b" ").decode(errors="replace")
            if cmdline_part in cmdline:
                found.append(pid)
        return found

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
            while port_listening(port):
                assert time.monotonic() < deadline, f"port {port} still served after the server stopped"
                time.sleep(0.5)  # waiting for another process's socket to close


def serve_run(args: list[str], log_path: Path, direct: bool = False) -> ServeProcess:
    """`serve run`; `direct`: with Serve's direct ingress, waiting on the replica's own port."""
    serve = str(Path(sys.executable).with_name("serve"))
    if direct:
        return ServeProcess([serve, "run", *args], log_path, env=DIRECT_ENV, base_url=DIRECT_URL,
                            ports=(SERVE_RUN_PORT, DIRECT_PORT))
    return ServeProcess([serve, "run", *args], log_path)


@contextlib.contextmanager
def served(args: list[str], log_path: Path) -> Iterator[ServeProcess]:
    """`serve run` with direct ingress (answering `DIRECT_URL`), ready on
    entry and stopped on exit."""
    proc = serve_run(args, log_path, direct=True)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
