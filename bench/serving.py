"""Online serving benchmark over the OpenAI completions API (vLLM benchmark_serving style).

    python bench/serving.py [--servers rayvllm,vllm] [--request-rates 2,4,8,16,inf]
        [--num-prompts 200] [--input-len 128] [--output-len 128] [--seed 0]
        [--max-concurrency N] [--max-num-seqs 256] [--model DIR] [--json-out FILE]
        [--rayvllm-arg KEY=VALUE ...] [--vllm-arg=--FLAG ...] [--vllm-env KEY=VALUE ...]
    python bench/serving.py --url http://127.0.0.1:8000 [--model-name NAME] ...

Servers. With --servers the script starts each server itself, one after the
other (never two at once: this is a 2-core box), runs every rate against it and
stops it, so the figures a ratio compares come from the same workload, client
and machine state:
  rayvllm  `serve run --address local serve_app:build_app model=DIR
           max_num_seqs=K disable_access_log=true [--rayvllm-arg KEY=VALUE ...]`
           from the repo root (no access log, like vLLM's below).
           With --rayvllm-ingress direct (the default) the cluster starts
           with Serve's direct ingress (serve_builder.direct_ingress_env) and
           the benchmark talks to the replica on http://127.0.0.1:8200, as
           `rayvllm serve` serves; with proxy (RAY_SERVE_ENABLE_DIRECT_INGRESS=0,
           which serve_app leaves alone), to Serve's proxy on
           http://127.0.0.1:8000; with joined, `ray start --head` first
           and `serve run` joins it (RAY_ADDRESS), where serve_app puts the
           replica itself on http://127.0.0.1:8000. Ready when GET /health is 200 and GET
           /v1/models lists a model. Stopped with SIGINT to its process group
           (Serve shuts down), then every process left in its session is
           killed, then `ray stop --force` unless a Ray cluster that is not ours
           was already running when we started (ray stop is machine-wide).
  vllm     the peer virtualenv's `python -m vllm.entrypoints.openai.api_server
           --model DIR --port 8100 --dtype float32 --max-model-len L
           --max-num-seqs K [--vllm-arg ...]` with bench/throughput.py's vLLM
           environment (VLLM_CPU_KVCACHE_SPACE=4, VLLM_CPU_NUM_OF_RESERVED_CPU=0,
           ...; --vllm-env KEY=VALUE overrides). Start-up compiles the model:
           2-3 minutes on 2 cores. Stopped with SIGTERM to its process group,
           then every process left in its session (the VLLM::EngineCore child
           included) is killed.
Each server runs in its own session, so "every process it started" is exactly
the processes with that session id, whatever process group they moved to.
With --url alone the script benchmarks a server that is already running and
starts or stops nothing. The model name comes from GET /v1/models unless
--model-name is given.

Workload. For each rate, --num-prompts requests of exactly --input-len random
token ids (from [10, vocab - 10); vocab from --model's config.json), sent as
`prompt` token-id arrays so every server gets exactly the same tokens, with
max_tokens = --output-len, ignore_eos, temperature 0, `stream: true` and
`stream_options: {include_usage: true}` (or, with --no-stream, `stream: false`:
no TTFT then) to POST /v1/completions. Prompts are
seeded by (--seed, rate): identical for every server at a rate, but fresh for
each rate, so a prefix cache never hits across runs (each run would otherwise
find the previous run's prompts cached and its TTFT would shrink for that
reason alone). --prompt-seed (default: --seed) reseeds the prompts alone:
repeated runs against one live --url server then keep the same arrivals
while the prefix cache still never hits, so an A/B of a server-side change
is not a comparison of two different arrival patterns. With
--shared-prefixes N the prompts share N prefixes of --prefix-len ids round
robin (each rate draws its own), the rest of each prompt its own: a load a
prefix cache serves from the second request of each prefix on. A warmup of
--warmup-prompts concurrent requests precedes the first rate on each server.

Arrivals: a Poisson process at each rate of --request-rates ("inf" = all
requests at once), seeded by (--seed, rate), with its gaps rescaled so the n
requests span exactly (n - 1) / rate seconds: a Poisson process conditioned on
that span, so every run offers exactly its nominal rate instead of +-10% drawn
by chance. --max-concurrency caps requests in flight (later arrivals wait for a
slot; their timing starts when they are sent), as in vLLM's benchmark.

Per request: TTFT = time to the first streamed chunk that carries a choice (a
token's text, possibly empty while the detokenizer holds a partial character;
vLLM's benchmark uses the same rule), e2e latency = time to the end of the
stream, output tokens = usage.completion_tokens (else the number of choice
chunks), TPOT = (e2e - TTFT) / (output tokens - 1). A request fails on a
non-200 status, an error chunk, a client timeout (--request-timeout) or a stream
that ends without `[DONE]`.

Per (server, rate): completed/failed, duration (first send to last completion),
request throughput = completed / duration, output and total (input + output)
token throughput, TTFT / TPOT / e2e p50 and p99 (linear interpolation).
"Sustained" (column sust.): no request failed and the achieved request
throughput is >= 90% of the offered rate, where achieved = (completed - 1) /
(last completion - first completion). That departure rate matches the arrival
rate when the server keeps up and falls to its capacity when it does not;
completed / duration would also count the drain of the last request, which on
a 25 s run is ~15% of the time however fast the server is.

The last lines compare the servers when both ran: rayvllm / vllm output token
throughput at the highest rate (saturation), and p50 TTFT of both at the
highest finite rate vLLM sustained.

The client (aiohttp, in this process) shares the 2 cores with the server; it
parses a few thousand small SSE chunks per second at most, the same load for
every server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    REPO_ROOT,
    build_model,
    default_model_dir,
    format_table,
    model_vocab_size,
    percentile,
    random_ids,
)
from throughput import _parse_env, vllm_env  # noqa: E402

try:
    import aiohttp
except ImportError:  # pragma: no cover - the project environment has it
    raise SystemExit("bench/serving.py needs aiohttp (pip install aiohttp)") from None

SERVERS = ("rayvllm", "vllm")
# serve_app's HTTP proxy listens on Serve's default port; with direct
# ingress the replica answers on its own port too (not the tests' 8100).
RAYVLLM_PROXY_PORT = 8000
RAYVLLM_DIRECT_PORT = 8200
DEFAULT_VLLM_PORT = 8100
# A rate is "sustained" when the departure rate reaches this share of it.
SUSTAINED_FRACTION = 0.9
# Warmup requests decode this many tokens at most: enough to reach the decode
# batch shapes, few enough to keep the warmup short.
WARMUP_OUTPUT_TOKENS = 16
# Processes that only a running Ray cluster has; used to tell whether a
# cluster other than ours is up before `ray stop --force` would kill it.
RAY_DAEMONS = ("raylet", "gcs_server")


# --------------------------------------------------------------------------- #
# Processes: one session per server, swept by session id at the end.
# --------------------------------------------------------------------------- #


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(comm, state, session id) of `pid`, or None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # comm may itself contain spaces or parentheses: it ends at the last ')'.
    lpar, rpar = data.find("("), data.rfind(")")
    fields = data[rpar + 2 :].split()
    # After comm: state, ppid, pgrp, session, ...
    return data[lpar + 1 : rpar], fields[0], int(fields[3])


def _cmdline(pid: int) -> str:
    """`pid`'s command line for messages (comm when the cmdline is unreadable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        text = ""
    if not text:
        stat = _proc_stat(pid)
        text = stat[0] if stat else "?"
    return text[:120]


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session id is `sid`.

    Zombies are left out: they are already dead, cannot be signalled, and
    their parent or init reaps them.
    """
    members = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None and stat[2] == sid and stat[1] != "Z" and pid != os.getpid():
            members.append(pid)
    return members


def ray_daemons(exclude_session: int | None = None) -> list[int]:
    """Pids of Ray cluster daemons on this machine, except those in `exclude_session`."""
    found = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None and stat[0] in RAY_DAEMONS and stat[1] != "Z" and stat[2] != exclude_session:
            found.append(pid)
    return found


def _signal_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(sid: int, timeout_s: float) -> list[int]:
    """Poll until session `sid` has no live member or `timeout_s` passes; returns the survivors."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = session_members(sid)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def port_in_use(port: int) -> bool:
    """True when something accepts connections on 127.0.0.1:`port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _listening_inodes(port: int) -> set[int]:
    """Socket inodes of every TCP (v4 and v6) socket in LISTEN state on `port`."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode.
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def foreign_listeners(port: int, sid: int) -> list[str]:
    """Processes outside session `sid` that listen on `port`, as "pid cmdline".

    Ray Serve binds its HTTP port with SO_REUSEPORT, so a second Serve app on
    the same port (another engineer's test, say) starts without an error and
    the kernel then splits our connections between the two servers. Only
    looking at who owns the listening sockets reveals that.
    """
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    targets = {f"socket:[{inode}]" for inode in inodes}
    found = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is None or stat[2] == sid:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    found.append(f"{pid} {_cmdline(pid)}")
                    break
            except OSError:
                continue
    return found


def _http_get_json(url: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    """(status, parsed JSON body or None) of GET `url`; status 0 when it did not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


def discover_model_name(base_url: str) -> str | None:
    """The first model id GET /v1/models lists, or None while it lists none."""
    status, body = _http_get_json(base_url + "/v1/models")
    if status != 200 or not isinstance(body, dict):
        return None
    data = body.get("data") or []
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        return None
    return str(data[0]["id"])


@dataclass
class ServerLaunch:
    """How to start one server, where it answers, and how to stop it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    port: int
    # First signal to the process group: the one that makes it shut down cleanly.
    stop_signal: int
    # Whether to run `ray stop --force` after the session sweep (rayvllm).
    ray_stop: bool
    # What answers 200 once it is up (Ray Serve LLM has no /health; Serve's proxy has /-/healthz).
    health_path: str = "/health"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _sigint_default() -> None:
    """In the server's process before it execs: SIGINT back to its default,
    so that the server's own Ctrl-C handling (its graceful stop) runs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class ServerProcess:
    """One server child in its own session, with its output in a log file."""

    def __init__(self, launch: ServerLaunch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        # Ray daemons that were up before we started: not ours to stop.
        self.foreign_ray: list[int] = []

    def start(self) -> None:
        """Launch the server; raises RuntimeError when its port is already taken."""
        if port_in_use(self.launch.port):
            # Readiness checks would otherwise pass against someone else's server.
            raise RuntimeError(f"port {self.launch.port} is already in use; stop whatever listens there first")
        if self.launch.ray_stop:
            self.foreign_ray = ray_daemons()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.launch.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.launch.env,
                cwd=self.launch.cwd,
                # New session (and process group): Ctrl-C at our terminal does not
                # reach it, and its session id names everything it starts.
                start_new_session=True,
                # A bench started in the background by a shell without job
                # control has SIGINT ignored, which its children inherit: the
                # server would then sit out the stop's grace period.
                preexec_fn=_sigint_default,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 25) -> list[str]:
        """The last `n` lines of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return []
        return lines[-n:]

    def wait_ready(self, timeout_s: float) -> tuple[float, str]:
        """Block until /health is 200 and /v1/models lists a model; returns (seconds, model id).

        Raises RuntimeError when the server exits or `timeout_s` passes first.
        """
        assert self.proc is not None
        base = self.launch.base_url
        t0 = time.monotonic()
        while True:
            if not self.alive():
                # The last log line is usually the exception that killed it.
                last = next((ln.strip() for ln in reversed(self.log_tail()) if ln.strip()), "no output")
                raise RuntimeError(
                    f"{self.launch.name} exited with code {self.proc.returncode} during start-up: {last}"
                )
            status, _ = _http_get_json(base + self.launch.health_path, timeout_s=2.0)
            if status == 200:
                # /health may answer before the app (Serve) or the model list is up.
                name = discover_model_name(base)
                if name is not None:
                    return time.monotonic() - t0, name
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{self.launch.name} not ready after {timeout_s:.0f} s")
            time.sleep(1.0)

    def stop(self, grace_s: float = 30.0) -> list[str]:
        """Stop the server and everything it started; returns processes that survived (should be none)."""
        if self.proc is None:
            return []
        sid = self.proc.pid
        if self.alive():
            try:
                os.killpg(sid, self.launch.stop_signal)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(sid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        # Children that outlived the leader or left its process group (Ray's
        # daemons call setpgrp, vLLM's engine core may linger) keep the session id.
        left = session_members(sid)
        if left:
            _signal_pids(left, signal.SIGTERM)
            left = _wait_gone(sid, 10.0)
        if left:
            _signal_pids(left, signal.SIGKILL)
            left = _wait_gone(sid, 5.0)
        survivors = [f"{pid} {_cmdline(pid)}" for pid in left]
        if self.launch.ray_stop:
            self._ray_stop()
        return survivors

    def _ray_stop(self) -> None:
        """`ray stop --force`, but only when no other Ray cluster was up before ours."""
        if self.foreign_ray:
            print(
                f"  not running `ray stop --force`: Ray daemons {self.foreign_ray} were running before "
                "the server started and are not ours; ours were stopped by session",
                flush=True,
            )
            return
        ray_exe = Path(sys.executable).with_name("ray")
        argv = [str(ray_exe)] if ray_exe.exists() else [shutil.which("ray") or "ray"]
        try:
            subprocess.run([*argv, "stop", "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"  ray stop --force failed: {exc}", flush=True)


def rayvllm_launch(model: str, args: argparse.Namespace) -> ServerLaunch:
    """`serve run` of serve_app:build_app from the repo root."""
    serve_exe = Path(sys.executable).with_name("serve")
    serve = str(serve_exe) if serve_exe.exists() else (shutil.which("serve") or "serve")
    # No access log line per request, as vLLM runs with --disable-uvicorn-access-log.
    app_args = [f"model={model}", f"max_num_seqs={args.max_num_seqs}", "disable_access_log=true"]
    for item in args.rayvllm_arg:
        if "=" not in item:
            raise SystemExit(f"--rayvllm-arg wants KEY=VALUE, got {item!r}")
        app_args.append(item)
    env = dict(os.environ)
    port = RAYVLLM_PROXY_PORT
    target = ["serve_app:build_app", *app_args]
    # --address local: a fresh local cluster, never someone else's `ray start` cluster.
    argv = [serve, "run", "--address", "local", *target]
    if args.rayvllm_ingress == "direct":
        from rayvllm.entrypoints.serve_builder import direct_ingress_env

        env |= direct_ingress_env(RAYVLLM_DIRECT_PORT)
        port = RAYVLLM_DIRECT_PORT
    elif args.rayvllm_ingress == "joined":
        from rayvllm.utils.network import free_port

        # A cluster from `ray start` (in this server's session, swept with
        # it), which `serve run` joins: serve_app starts Serve there with
        # direct ingress on serve run's port, the proxy one above.
        ray_exe = str(Path(serve).with_name("ray"))
        gcs_port = free_port()
        # Token authentication on both sides, as in the local cluster that
        # `ray.init` starts (a driver joining by address follows the
        # cluster's mode only when told).
        env |= {"RAY_ADDRESS": f"127.0.0.1:{gcs_port}", "RAY_AUTH_MODE": "token"}
        start = [ray_exe, "start", "--head", f"--port={gcs_port}", "--include-dashboard=false",
                 "--disable-usage-stats"]
        token = [ray_exe, "get-auth-token", "--generate"]
        argv = ["bash", "-c", f"{shlex.join(token)} > /dev/null && {shlex.join(start)} > /dev/null && "
                              f"exec {shlex.join([serve, 'run', *target])}"]
    else:
        # A direct-ingress setting of the user's: serve_app leaves Serve as it is.
        env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0"
    return ServerLaunch(
        name="rayvllm",
        argv=argv,
        env=env,
        cwd=str(REPO_ROOT),
        port=port,
        stop_signal=signal.SIGINT,
        ray_stop=True,
    )


def vllm_launch(model: str, args: argparse.Namespace, max_model_len: int, log_dir: Path) -> ServerLaunch:
    """vLLM's OpenAI server from the peer virtualenv, with throughput.py's CPU environment."""
    argv = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(args.vllm_port),
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--seed", str(args.seed),
        "--disable-uvicorn-access-log",
    ]
    for item in args.vllm_arg:
        argv.extend(shlex.split(item))
    env = dict(os.environ)
    env.update(vllm_env(_parse_env(args.vllm_env)))
    return ServerLaunch(
        name="vllm",
        argv=argv,
        env=env,
        # Not the repo root: `python -m` puts the cwd first on sys.path, and the
        # repo's top-level folders (kernels/, tests/, ...) could shadow vLLM's imports.
        cwd=str(log_dir),
        port=args.vllm_port,
        stop_signal=signal.SIGTERM,
        ray_stop=False,
    )


# --------------------------------------------------------------------------- #
# Client: one streamed completion per request, Poisson arrivals per rate.
# --------------------------------------------------------------------------- #


@dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    index: int
    success: bool
    prompt_tokens: int
    output_tokens: int
    # Send time relative to the start of the run.
    sent_s: float
    ttft_s: float | None
    latency_s: float | None
    error: str | None = None

    @property
    def done_s(self) -> float:
        """Completion time relative to the start of the run."""
        return self.sent_s + (self.latency_s or 0.0)


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    model_name: str,
    prompt: list[int],
    max_tokens: int,
    index: int,
    run_t0: float,
    stream: bool = True,
) -> RequestResult:
    """POST one completion (streamed unless `stream` is False: then it has
    no TTFT, only its latency) and time it; never raises (failures are results)."""
    payload = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    ttft: float | None = None
    choice_chunks = 0
    usage: dict[str, Any] | None = None
    saw_done = False
    error: str | None = None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = await resp.text()
                error = f"HTTP {resp.status}: {' '.join(body.split())[:200]}"
            elif not stream:
                whole = await resp.json()
                usage, saw_done = whole.get("usage"), True
                choice_chunks = len(whole.get("choices") or [])
            else:
                # aiohttp's StreamReader iterates line by line; SSE events are
                # "data: <json>" lines separated by blank lines.
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, ": ping" comments, other fields
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        saw_done = True
                        break
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        error = f"error chunk: {json.dumps(chunk['error'])[:200]}"
                        break
                    if chunk.get("choices"):
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        choice_chunks += 1
                    if chunk.get("usage"):
                        usage = chunk["usage"]
    except asyncio.TimeoutError:
        error = "client timeout (--request-timeout)"
    except (aiohttp.ClientError, ValueError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - start
    if error is None and not saw_done:
        error = "stream ended without [DONE]"
    if error is None and ttft is None and stream:
        error = "no chunk with a choice (no TTFT)"
    output_tokens = int(usage.get("completion_tokens") or 0) if usage else choice_chunks
    prompt_tokens = int(usage.get("prompt_tokens") or len(prompt)) if usage else len(prompt)
    return RequestResult(
        index=index,
        success=error is None,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        sent_s=start - run_t0,
        ttft_s=ttft,
        latency_s=latency,
        error=error,
    )


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (s from the run's start) of `n` Poisson arrivals at `rate` per second.

    The first request goes at 0; the n - 1 exponential gaps are rescaled to
    sum to exactly (n - 1) / rate (a Poisson process conditioned on that span)
    so the offered rate is the nominal one. rate = inf sends all at once.
    """
    if math.isinf(rate) or n <= 1:
        return [0.0] * n
    gaps = [rng.expovariate(rate) for _ in range(n - 1)]
    scale = ((n - 1) / rate) / sum(gaps)
    offsets = [0.0]
    for gap in gaps:
        offsets.append(offsets[-1] + gap * scale)
    return offsets


async def run_requests(
    session: aiohttp.ClientSession,
    url: str,
    model_name: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    offsets: Sequence[float],
    max_concurrency: int | None,
    stream: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send prompt i at offsets[i] (at most `max_concurrency` in flight); returns (results, duration s)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        # Absolute send times rather than chained sleeps: no drift over the run.
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            return await send_request(session, url, model_name, prompts[i], max_tokens, i, t0, stream)
        async with semaphore:
            return await send_request(session, url, model_name, prompts[i], max_tokens, i, t0, stream)

    results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return list(results), time.perf_counter() - t0


def summarise(results: Sequence[RequestResult], duration_s: float, rate: float, output_len: int) -> dict[str, Any]:
    """Per-run metrics (times in ms) from the request results."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [1e3 * r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [
        1e3 * (r.latency_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.latency_s is not None and r.ttft_s is not None and r.output_tokens > 1
    ]
    e2es = [1e3 * r.latency_s for r in ok if r.latency_s is not None]
    done = sorted(r.done_s for r in ok)
    # Departure rate between the first and the last completion (see the module docstring).
    departure_rate = (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else None
    sustained: bool | None = None
    if not math.isinf(rate):
        sustained = (
            len(ok) == len(results)
            and departure_rate is not None
            and departure_rate >= SUSTAINED_FRACTION * rate
        )
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    metrics: dict[str, Any] = {
        "rate": None if math.isinf(rate) else rate,
        "rate_label": rate_label(rate),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "departure_rate": departure_rate,
        "sustained": sustained,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # ignore_eos asks for exactly output_len tokens; anything else is a server bug.
        "wrong_output_len": sum(1 for r in ok if r.output_tokens != output_len),
        "errors": errors,
    }
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("e2e_ms", e2es)):
        metrics[f"{name}_mean"] = sum(values) / len(values) if values else None
        metrics[f"{name}_p50"] = percentile(values, 50)
        metrics[f"{name}_p99"] = percentile(values, 99)
    return metrics


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def make_prompts(
    num: int, input_len: int, vocab: int, seed: int, tag: str, shared_prefixes: int = 0, prefix_len: int = 0
) -> list[list[int]]:
    """`num` prompts of `input_len` random ids, seeded by (seed, tag): same for every server. With
    `shared_prefixes` N > 0, prompt i starts with prefix i % N (`prefix_len` ids, drawn once per tag)
    and ends with its own ids: a mix that a prefix cache serves from its second request on."""
    rng = random.Random(f"serving-{seed}-{tag}")
    if shared_prefixes <= 0:
        return [random_ids(rng, input_len, vocab) for _ in range(num)]
    prefixes = [random_ids(rng, prefix_len, vocab) for _ in range(shared_prefixes)]
    return [prefixes[i % shared_prefixes] + random_ids(rng, input_len - prefix_len, vocab) for i in range(num)]


async def _watch_port(intruders: Callable[[], list[str]], seen: set[str], every_s: float = 2.0) -> None:
    """Add whatever `intruders()` reports to `seen` every `every_s` seconds until cancelled.

    A run lasts long enough for a test's server to come and go in between
    two checks at its ends; a /proc scan costs a few ms, in a worker thread.
    """
    while True:
        seen.update(await asyncio.to_thread(intruders))
        await asyncio.sleep(every_s)


async def bench_server(
    base_url: str,
    model_name: str,
    rates: Sequence[float],
    vocab: int,
    args: argparse.Namespace,
    label: str,
    intruders: Callable[[], list[str]] | None = None,
) -> list[dict[str, Any]]:
    """Warmup, then one run per rate against `base_url`; returns one metrics dict per rate.

    `intruders`, when given, lists other processes listening on the server's
    port; it is checked before and after each run, and a run that had any is
    flagged (its requests may have gone to the other server).
    """
    url = base_url + "/v1/completions"
    prompt_seed = args.seed if args.prompt_seed is None else args.prompt_seed
    # limit=0: aiohttp's default pool of 100 connections would cap concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    runs: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if args.warmup_prompts > 0:
            warm = make_prompts(args.warmup_prompts, args.input_len, vocab, prompt_seed, "warmup")
            t0 = time.perf_counter()
            results, _ = await run_requests(
                session, url, model_name, warm, min(WARMUP_OUTPUT_TOKENS, args.output_len),
                [0.0] * len(warm), None, not args.no_stream,
            )
            bad = [r for r in results if not r.success]
            print(f"  [{label}] warmup: {len(results) - len(bad)}/{len(results)} ok in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            if len(bad) == len(results):
                raise RuntimeError(f"every warmup request failed, e.g. {bad[0].error}")
        for rate in rates:
            seen: set[str] = set()
            watcher = asyncio.create_task(_watch_port(intruders, seen)) if intruders else None
            prompts = make_prompts(args.num_prompts, args.input_len, vocab, prompt_seed, f"rate-{rate_label(rate)}",
                                   args.shared_prefixes, args.prefix_len)
            offsets = arrival_offsets(len(prompts), rate, random.Random(f"arrivals-{args.seed}-{rate_label(rate)}"))
            try:
                results, duration = await run_requests(
                    session, url, model_name, prompts, args.output_len, offsets, args.max_concurrency,
                    not args.no_stream,
                )
            finally:
                if watcher is not None:
                    watcher.cancel()
            if intruders:
                # One last look: the watcher sleeps between checks.
                seen.update(intruders())
            metrics = summarise(results, duration, rate, args.output_len)
            metrics["server"] = label
            metrics["other_listeners"] = sorted(seen)
            if seen:
                print(f"  [{label}] WARNING: other processes listened on the server's port during this run, "
                      f"so some requests may have reached them: {sorted(seen)}", flush=True)
            metrics["requests"] = [asdict(r) for r in results]
            runs.append(metrics)
            print(
                f"  [{label}] rate {rate_label(rate)}: {metrics['completed']}/{len(results)} ok in {duration:.1f} s, "
                f"{metrics['output_throughput']:.1f} out tok/s, TTFT p50 {_fmt(metrics['ttft_ms_p50'], 0)} ms"
                + (f"; errors: {metrics['errors']}" if metrics["errors"] else ""),
                flush=True,
            )
            if metrics["wrong_output_len"]:
                print(f"  [{label}] warning: {metrics['wrong_output_len']} request(s) returned other than "
                      f"{args.output_len} tokens despite ignore_eos", flush=True)
    return runs


# --------------------------------------------------------------------------- #
# Report.
# --------------------------------------------------------------------------- #


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(runs: Sequence[dict[str, Any]], server_errors: dict[str, str], args: argparse.Namespace) -> None:
    headers = ["server", "rate", "ok/fail", "dur s", "req/s", "sust.", "out tok/s", "tot tok/s",
               "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "E2E p99", "notes"]
    rows = []
    for m in runs:
        sust = "-" if m["sustained"] is None else ("yes" if m["sustained"] else "no")
        notes = []
        if m["errors"]:
            # The most frequent error stands for the rest; the JSON has them all.
            err, count = max(m["errors"].items(), key=lambda kv: kv[1])
            notes.append(f"{count}x " + " ".join(err.split())[:80])
        if m["wrong_output_len"]:
            notes.append(f"{m['wrong_output_len']} with != {args.output_len} output tokens")
        if m.get("other_listeners"):
            notes.append("INVALID: another server shared the port (pid " + m["other_listeners"][0].split()[0] + ")")
        rows.append([
            m["server"], m["rate_label"], f"{m['completed']}/{m['failed']}", f"{m['duration_s']:.1f}",
            f"{m['request_throughput']:.2f}", sust, f"{m['output_throughput']:.1f}",
            f"{m['total_token_throughput']:.1f}", _fmt(m["ttft_ms_p50"]), _fmt(m["ttft_ms_p99"]),
            _fmt(m["tpot_ms_p50"]), _fmt(m["tpot_ms_p99"]),
            _fmt(None if m["e2e_ms_p50"] is None else m["e2e_ms_p50"] / 1e3, 2),
            _fmt(None if m["e2e_ms_p99"] is None else m["e2e_ms_p99"] / 1e3, 2),
            "; ".join(notes),
        ])
    for name, err in server_errors.items():
        rows.append([name, *["-"] * (len(headers) - 2), "error: " + " ".join(err.split())[:160]])
    print()
    print(format_table(headers, rows))
    cap = f", max concurrency {args.max_concurrency}" if args.max_concurrency else ""
    print(
        f"({args.num_prompts} requests per rate, {args.input_len} prompt + {args.output_len} output tokens each"
        f"{cap}; TTFT/TPOT in ms, E2E in s; sust. = no failure and departure rate >= "
        f"{SUSTAINED_FRACTION:.0%} of the offered rate; {platform.machine()}, {os.cpu_count()} CPUs)"
    )


def compare(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """rayvllm vs vllm: output throughput at the top rate, p50 TTFT at vLLM's top sustained rate."""
    by = {(m["server"], m["rate_label"]): m for m in runs}
    servers = {m["server"] for m in runs}
    if not {"rayvllm", "vllm"} <= servers:
        return None
    out: dict[str, Any] = {}

    def key(m: dict[str, Any]) -> float:
        return math.inf if m["rate"] is None else m["rate"]

    vllm_runs = sorted((m for m in runs if m["server"] == "vllm"), key=key)
    top = vllm_runs[-1]["rate_label"]
    ray_top, vllm_top = by.get(("rayvllm", top)), by.get(("vllm", top))
    if ray_top and vllm_top and vllm_top["output_throughput"] > 0:
        out["top_rate"] = top
        out["output_throughput_ratio"] = ray_top["output_throughput"] / vllm_top["output_throughput"]
        out["output_throughput"] = {"rayvllm": ray_top["output_throughput"], "vllm": vllm_top["output_throughput"]}
    # A run whose port another server shared may have measured that server instead.
    out["invalid"] = any(m.get("other_listeners") for m in runs)
    sustained = [m for m in vllm_runs if m["sustained"]]
    if sustained:
        rate = sustained[-1]["rate_label"]
        ray_m = by.get(("rayvllm", rate))
        out["vllm_top_sustained_rate"] = rate
        out["ttft_p50_ms"] = {"rayvllm": ray_m["ttft_ms_p50"] if ray_m else None, "vllm": sustained[-1]["ttft_ms_p50"]}
        out["rayvllm_sustained_there"] = bool(ray_m and ray_m["sustained"])
    else:
        out["vllm_top_sustained_rate"] = None
    return out


def print_comparison(cmp: dict[str, Any] | None) -> None:
    if cmp is None:
        return
    print()
    if cmp.get("invalid"):
        print("WARNING: another server shared a benchmarked port during some run (see notes); "
              "the comparison below is not trustworthy")
    if "output_throughput_ratio" in cmp:
        t = cmp["output_throughput"]
        print(
            f"rayvllm / vllm output tok/s at rate {cmp['top_rate']} (saturation): "
            f"{cmp['output_throughput_ratio']:.2f}x ({t['rayvllm']:.1f} vs {t['vllm']:.1f})"
        )
    else:
        print("rayvllm / vllm output tok/s at the top rate: n/a (a server has no result there)")
    rate = cmp["vllm_top_sustained_rate"]
    if rate is None:
        print("p50 TTFT at vLLM's highest sustained rate: n/a (vLLM sustained no finite rate)")
        return
    ttft = cmp["ttft_p50_ms"]
    ratio = f", {ttft['rayvllm'] / ttft['vllm']:.2f}x" if ttft["rayvllm"] and ttft["vllm"] else ""
    note = "" if cmp["rayvllm_sustained_there"] else "; rayvllm did NOT sustain this rate"
    print(
        f"p50 TTFT at rate {rate} (highest vLLM sustained): rayvllm {_fmt(ttft['rayvllm'])} ms vs "
        f"vllm {_fmt(ttft['vllm'])} ms{ratio}{note}"
    )


# --------------------------------------------------------------------------- #
# Main.
# --------------------------------------------------------------------------- #


def parse_rates(text: str) -> list[float]:
    rates = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            rate = float(item)
        except ValueError:
            raise SystemExit(f"--request-rates wants numbers or inf, got {item!r}") from None
        if not rate > 0:
            raise SystemExit(f"request rates must be > 0, got {item!r}")
        rates.append(rate)
    if not rates:
        raise SystemExit("--request-rates is empty")
    return rates


def resolve_model(arg: str | None) -> str:
    """--model, else the llama25m preset (built on first use)."""
    if arg:
        return str(Path(arg).resolve())
    path = default_model_dir("llama25m")
    # A complete directory needs no rayvllm import (whose sources may be mid-edit).
    if (path / ".rayvllm-complete").exists():
        return str(path)
    return str(build_model(None, "llama25m"))


def _raise_interrupt(signum: int, frame: Any) -> None:
    # SIGTERM behaves like Ctrl-C, so the finally blocks stop the server.
    raise KeyboardInterrupt


def run_launched(
    name: str, model: str, rates: list[float], vocab: int, max_model_len: int, args: argparse.Namespace,
    log_dir: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start server `name`, benchmark every rate, stop it; returns (runs, server info with "error" on failure)."""
    if name == "rayvllm":
        launch = rayvllm_launch(model, args)
    else:
        launch = vllm_launch(model, args, max_model_len, log_dir)
    info: dict[str, Any] = {"argv": launch.argv, "base_url": launch.base_url}
    if name == "rayvllm" and not (REPO_ROOT / "serve_app.py").exists():
        info["error"] = "serve_app.py not found at the repo root"
        return [], info
    if name == "vllm" and not os.path.exists(args.vllm_python):
        info["error"] = f"{args.vllm_python} missing; run bench/setup_peers.sh"
        return [], info
    log_path = log_dir / f"{name}.log"
    info["log"] = str(log_path)
    server = ServerProcess(launch, log_path)
    runs: list[dict[str, Any]] = []
    print(f"[{name}] starting: {shlex.join(launch.argv)}\n  log: {log_path}", flush=True)
    try:
        server.start()
        startup_s, served = server.wait_ready(args.startup_timeout)
        model_name = args.model_name or served
        info.update(startup_s=startup_s, model_name=model_name)
        print(f"[{name}] ready after {startup_s:.1f} s, model {model_name!r}", flush=True)
        sid = server.proc.pid if server.proc is not None else -1
        runs = asyncio.run(bench_server(
            launch.base_url, model_name, rates, vocab, args, name,
            intruders=lambda: foreign_listeners(launch.port, sid),
        ))
    except Exception as exc:  # noqa: BLE001 - one server's failure becomes its table row
        info["error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
        print(f"[{name}] failed: {exc}\n  last log lines:\n    " + "\n    ".join(server.log_tail()), flush=True)
    finally:
        # A second Ctrl-C (or SIGTERM) must not cut the cleanup short and leave
        # the server's processes behind; every wait in stop() is bounded.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        t0 = time.monotonic()
        try:
            survivors = server.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        print(f"[{name}] stopped in {time.monotonic() - t0:.1f} s", flush=True)
        if survivors:
            info["left_running"] = survivors
            print(f"[{name}] WARNING: still running after SIGKILL: {survivors}", flush=True)
    return runs, info


def main() -> None:
    args = build_parser().parse_args()
    if args.url and args.servers:
        raise SystemExit("give either --url (a running server) or --servers (launched here), not both")
    names = [s.strip() for s in (args.servers or ",".join(SERVERS)).split(",") if s.strip()] if not args.url else []
    unknown = [s for s in names if s not in SERVERS]
    if unknown:
        raise SystemExit(f"unknown server(s) {unknown}; choose from {', '.join(SERVERS)}")
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be >= 1")
    rates = parse_rates(args.request_rates)
    # Checked now, not when rayvllm's turn comes after minutes of vLLM.
    bad = [item for item in args.rayvllm_arg if "=" not in item]
    if bad:
        raise SystemExit(f"--rayvllm-arg wants KEY=VALUE, got {bad}")
    model = resolve_model(args.model)
    vocab = model_vocab_size(model)
    with open(Path(model) / "config.json") as f:
        positions = int(json.load(f).get("max_position_embeddings", 2048))
    max_model_len = args.max_model_len or positions
    if args.shared_prefixes > 0 and not 0 < args.prefix_len < args.input_len:
        raise SystemExit("--shared-prefixes needs 0 < --prefix-len < --input-len")
    if args.input_len + args.output_len > max_model_len:
        raise SystemExit(f"a request needs {args.input_len + args.output_len} positions; max model len is {max_model_len}")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="rayvllm-serving-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"model {model} (vocab {vocab})\n{args.num_prompts} requests per rate, {args.input_len} prompt + "
        f"{args.output_len} output tokens; rates {', '.join(rate_label(r) for r in rates)}; "
        f"servers: {args.url or ', '.join(names)}",
        flush=True,
    )

    runs: list[dict[str, Any]] = []
    servers: dict[str, dict[str, Any]] = {}
    if args.url:
        label = args.label
        base = args.url.rstrip("/")
        model_name = args.model_name or discover_model_name(base)
        servers[label] = {"base_url": base, "model_name": model_name}
        if model_name is None:
            servers[label]["error"] = f"GET {base}/v1/models listed no model; pass --model-name"
        else:
            try:
                runs = asyncio.run(bench_server(base, model_name, rates, vocab, args, label))
            except RuntimeError as exc:
                servers[label]["error"] = str(exc)
    else:
        for name in names:
            server_runs, servers[name] = run_launched(name, model, rates, vocab, max_model_len, args, log_dir)
            runs.extend(server_runs)

    errors = {name: info["error"] for name, info in servers.items() if "error" in info}
    print_table(runs, errors, args)
    cmp = compare(runs)
    print_comparison(cmp)
    if args.json_out:
        config = {k: v for k, v in vars(args).items()}
        config.update(model=model, vocab_size=vocab, max_model_len=max_model_len, rates=[rate_label(r) for r in rates],
                      cpu_count=os.cpu_count(), machine=platform.machine())
        with open(args.json_out, "w") as f:
            json.dump({"config": config, "servers": servers, "runs": runs, "comparison": cmp}, f, indent=2)
        print(f"wrote {args.json_out}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None,
                   help=f"comma-separated servers to launch, one after the other ({','.join(SERVERS)}; the default)")
    p.add_argument("--url", default=None, help="benchmark an already running server at this base URL instead")
    p.add_argument("--label", default="url", help="name of the --url server in the table")
    p.add_argument("--model-name", default=None, help="model name for requests (default: from GET /v1/models)")
    p.add_argument("--model", default=None, help="model dir (default: llama25m preset in ~/.cache/rayvllm)")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--request-rates", default="2,4,8,16,inf", help="comma-separated requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--no-stream", action="store_true",
                   help="whole responses (`stream: false`): throughput and latency, no TTFT")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-seed", type=int, default=None, help="seed of the prompts alone (default: --seed)")
    p.add_argument("--shared-prefixes", type=int, default=0,
                   help="prompts share this many distinct prefixes, round robin (0: every prompt random)")
    p.add_argument("--prefix-len", type=int, default=0, help="ids in each shared prefix (< --input-len)")
    p.add_argument("--warmup-prompts", type=int, default=8, help="concurrent warmup requests per server (0: none)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request before it fails")
    p.add_argument("--max-num-seqs", type=int, default=256, help="max_num_seqs for both launched servers")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM --max-model-len (default: the model's max_position_embeddings)")
    p.add_argument("--rayvllm-ingress", choices=("direct", "proxy", "joined"), default="direct",
                   help="talk to the replica itself (Serve's direct ingress), through Serve's proxy, or "
                        "to the replica of a `serve run` that joined a cluster from `ray start`")
    p.add_argument("--rayvllm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `serve run serve_app:build_app` argument (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARGS",
                   help="extra vLLM server CLI arguments, e.g. --vllm-arg=--enforce-eager (repeatable)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for the vLLM server over bench/throughput.py's defaults")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--vllm-port", type=int, default=DEFAULT_VLLM_PORT)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a launched server to get ready")
    p.add_argument("--log-dir", default=None, help="server logs go here (default: a new temp dir)")
    p.add_argument("--json-out", default=None)
    return p


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        # run_launched's finally has already stopped the server; a traceback adds nothing.
        print("interrupted", file=sys.stderr)
        sys.exit(130)
