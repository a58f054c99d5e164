"""`ray up` of infra/cluster-local.yaml, end to end, on this machine.

The cluster commands of docs/DEPLOY.md, run for real: `ray up -y` over SSH to
127.0.0.1 (head only: a worker entry needs an address of its own, and a
second node on one host would have its `ray stop` end the head), the head's
own `serve deploy serve_config.yaml` with the demo model, a completion
through the official `openai` client on the replica's direct-ingress port,
then `ray down -y`.

The cluster config is the shipped file with data filled in, nothing else:
the test's user, key and SSH port (Ray's `ssh_proxy_command`), and free
ports in place of the fixed ones (GCS, dashboard, Ray client, dashboard
agent, Serve's proxy and the direct-ingress port), so the cluster cannot
meet another one on the machine. The setup commands run as written; uv's
and pip's download caches (a directory of their own, kept between runs)
spare a second run the downloads.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from rayvllm.entrypoints.serve_builder import DEFAULT_APP_NAME, DEMO_MODEL_NAME
from rayvllm.utils.network import free_port
from ssh_server import SSHD, SSHServer, NodeUser, ensure_debian_packages

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parent.parent
LOCAL_CLUSTER = REPO / "infra" / "cluster-local.yaml"
SERVE_CONFIG = REPO / "serve_config.yaml"
# pip's and uv's download caches for the cluster user, kept between runs.
DOWNLOAD_CACHE = Path("/var/cache/rayvllm-deploy-test")
RAY_UP_TIMEOUT_S = 600
READY_TIMEOUT_S = 300
RAY_DOWN_TIMEOUT_S = 180
# What `ray up` needs on both ends: the SSH server (the client is here),
# rsync for file_mounts, nc for the proxy command that reaches a non-22 port.
PACKAGES = {SSHD: "openssh-server", "ssh": "openssh-client", "rsync": "rsync", "nc": "netcat-openbsd"}


def distinct_free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def replace_once(text: str, old: str, new: str) -> str:
    """`old` must occur exactly once: a shipped file that changed shape
    fails here instead of being tested half-rewritten."""
    assert text.count(old) == 1, f"expected {old!r} once in {text!r}"
    return text.replace(old, new)


def cluster_config_for_test(
    user: str, key: Path, proxy_command: str, ports: dict[str, int], serve_config: Path
) -> dict[str, Any]:
    """infra/cluster-local.yaml with this machine's user, key, SSH port and
    free Ray/Serve ports; every command otherwise as shipped."""
    config = yaml.safe_load(LOCAL_CLUSTER.read_text())
    assert config["provider"]["head_ip"] == "127.0.0.1" and config["provider"]["worker_ips"] == []
    config["auth"] = {
        "ssh_user": user,
        "ssh_private_key": str(key),
        # ssh runs this instead of connecting to %h:22 itself.
        "ssh_proxy_command": proxy_command,
    }
    head = config["head_start_ray_commands"]
    (start_at,) = [i for i, c in enumerate(head) if "ray start --head" in c]
    start = replace_once(
        head[start_at], "--port=6379",
        f"--port={ports['gcs']} --dashboard-port={ports['dashboard']} "
        f"--ray-client-server-port={ports['client']} --dashboard-agent-listen-port={ports['agent']}",
    )
    start = replace_once(start, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=8200",
                         f"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT={ports['direct']}")
    head[start_at] = replace_once(start, "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=8201",
                                  f"RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT={ports['direct'] + 1}")
    # The same app on a free proxy port, synced like the checkout; `serve
    # deploy` asks the dashboard on its (moved) port.
    config["file_mounts"]["~/serve_config.yaml"] = str(serve_config)
    (deploy_at,) = [i for i, c in enumerate(head) if "serve deploy" in c]
    head[deploy_at] = replace_once(
        head[deploy_at], "serve deploy serve_config.yaml",
        f"serve deploy --address http://127.0.0.1:{ports['dashboard']} ~/serve_config.yaml",
    )
    return config


def serve_config_for_test(proxy_port: int) -> dict[str, Any]:
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    config["http_options"]["port"] = proxy_port
    return config


def node_pip_config() -> str:
    """The pip configuration this test runs under (its files and PIP_*
    variables: this network's mirrors, certificates and wheel folders), as a
    node on the same network would have it, plus the kept download cache.
    Two retries, not pip's five: an index this network cannot reach (the
    cluster file's PyTorch index, where only a mirror is reachable) fails
    each try at once, and five wait out pip's whole backoff (0.5 + 1 + 2 + 4 s)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True, timeout=60).stdout
    sections: dict[str, dict[str, str]] = {"global": {}}
    for line in listed.splitlines():
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
        if match:
            section = "global" if match.group(1) == ":env:" else match.group(1)
            sections.setdefault(section, {})[match.group(2)] = match.group(3)
    sections["global"]["cache-dir"] = str(DOWNLOAD_CACHE / "pip")
    sections["global"].setdefault("retries", "2")
    return "".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) for name, keys in sections.items())


def run_logged(argv: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """Run `argv` from the repository root (the cluster file's `.` is the
    checkout), output appended to `log`; its exit status, or 124 on timeout."""
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124
        finally:
            if proc.poll() is None:  # timed out, or the test was interrupted
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(path: Path, chars: int = 8000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def app_status(dashboard_port: int) -> str | None:
    """The app's status from Serve's REST API (what `serve status` prints)."""
    try:
        reply = requests.get(f"http://127.0.0.1:{dashboard_port}/api/serve/applications/", timeout=5)
        apps = reply.json().get("applications", {}) if reply.ok else {}
    except (requests.RequestException, ValueError):
        return None
    app = apps.get(DEFAULT_APP_NAME)
    return f"{app['status']}: {app.get('message', '')}" if app else None


def wait_until_serving(direct_port: int, dashboard_port: int, log: Path) -> None:
    """Until the replica answers /health 200 on its own port; fail at once
    when Serve reports the deploy failed."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    status = None
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{direct_port}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        status = app_status(dashboard_port)
        if status and status.startswith("DEPLOY_FAILED"):
            pytest.fail(f"serve deploy failed: {status}\n{tail(log)}")
        time.sleep(1.0)  # polling a replica that is still starting
    pytest.fail(f"no replica answered in {READY_TIMEOUT_S} s (app: {status})\n{tail(log)}")


@pytest.fixture
def machine() -> Iterator[tuple[NodeUser, SSHServer, Path]]:
    """This machine as a remote node: its SSH server and the cluster's user,
    all removed afterwards, whatever happened."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("needs root on Debian/Ubuntu: it installs and runs an SSH server and adds a user")
    ensure_debian_packages(PACKAGES)
    # Short: Ray's Unix sockets live under it (paths of at most 107 bytes).
    workdir = Path(tempfile.mkdtemp(prefix="rvd-"))
    workdir.chmod(0o755)  # the user's home is inside
    user = server = None
    try:
        user = NodeUser(workdir / "home")
        DOWNLOAD_CACHE.mkdir(parents=True, exist_ok=True)
        user.own(DOWNLOAD_CACHE)
        user.write(".config/pip/pip.conf", node_pip_config())
        ray_tmp = workdir / "r"
        ray_tmp.mkdir()
        user.own(ray_tmp)
        # The node's environment, read by every command Ray runs there: its
        # own Ray temp dir (another user's /tmp/ray is not writable to it),
        # uv's kept cache, and this network's CA bundle (uv reads SSL_CERT_FILE).
        exports = {"RAY_TMPDIR": str(ray_tmp), "UV_CACHE_DIR": str(DOWNLOAD_CACHE / "uv")}
        if "SSL_CERT_FILE" in os.environ:
            exports["SSL_CERT_FILE"] = os.environ["SSL_CERT_FILE"]
        with open(user.home / ".bashrc", "a") as bashrc:
            bashrc.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in exports.items()))
        server = SSHServer(workdir, user)
        server.check_login(user)
        yield user, server, workdir
    finally:
        started = time.monotonic()
        if server is not None:
            server.stop()
        if user is not None:
            user.remove()
        # The node's virtualenv is tens of thousands of files: rm is far
        # quicker at them than shutil.rmtree.
        subprocess.run(["rm", "-rf", str(workdir)], check=False, timeout=600)
        print(f"cleanup {time.monotonic() - started:.0f} s")


def test_ray_up_serve_deploy_complete_ray_down(machine: tuple[NodeUser, SSHServer, Path], tmp_path: Path) -> None:
    user, server, workdir = machine
    names = ["gcs", "dashboard", "client", "agent", "proxy", "direct"]
    ports = dict(zip(names, distinct_free_ports(len(names)), strict=True))
    serve_config = workdir / "serve_config.yaml"
    serve_config.write_text(yaml.safe_dump(serve_config_for_test(ports["proxy"])))
    cluster_file = workdir / "cluster-local.yaml"
    cluster_file.write_text(yaml.safe_dump(cluster_config_for_test(
        user.name, server.private_key, server.proxy_command, ports, serve_config)))

    launcher_tmp = workdir / "launcher"  # the local provider's state file, Ray's config cache
    launcher_tmp.mkdir()
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "TMPDIR": str(launcher_tmp),
        "RAY_TMPDIR": str(launcher_tmp),
    }
    log = tmp_path / "ray.log"  # kept by pytest after the run (the workdir is not)
    ray = str(bin_dir / "ray")
    down = [ray, "down", "-y", str(cluster_file)]
    try:
        started = time.monotonic()
        code = run_logged([ray, "up", "-y", str(cluster_file)], log, RAY_UP_TIMEOUT_S, env)
        assert code == 0, f"ray up exited {code}:\n{tail(log)}\nsshd:\n{server.log_tail()}"
        up_s = time.monotonic() - started
        wait_until_serving(ports["direct"], ports["dashboard"], log)
        ready_s = time.monotonic() - started

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{ports['direct']}/v1", api_key="unused", timeout=120)
        completion = client.completions.create(
            model=DEMO_MODEL_NAME, prompt="Hello, my name is", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert completion.choices[0].finish_reason == "length" and completion.choices[0].text
        # Serve's proxy, on serve_config.yaml's (here: moved) port, serves the same app.
        models = requests.get(f"http://127.0.0.1:{ports['proxy']}/v1/models", timeout=30)
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == [DEMO_MODEL_NAME]
        print(f"ray up {up_s:.0f} s, serving {ready_s:.0f} s after it began")
    finally:
        code = run_logged(down, log, RAY_DOWN_TIMEOUT_S, env)
    assert code == 0, f"ray down exited {code}:\n{tail(log)}"
    # `ray down` stopped Ray on the head (a plain `ray stop` there: the
    # setup put the virtualenv on the login shell's PATH).
    deadline = time.monotonic() + 60
    while leftover := ray_processes(user):
        assert time.monotonic() < deadline, f"ray down left Ray running: {leftover}\n{tail(log)}"
        time.sleep(0.5)  # processes that were sent SIGTERM exit on their own clock


def ray_processes(user: NodeUser) -> list[str]:
    """Command lines of the user's Ray daemons still running."""
    found = []
    for pid in user.processes():
        try:
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if re.search(r"\b(raylet|gcs_server)\b", cmdline):
            found.append(cmdline[:120])
    return found
