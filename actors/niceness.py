"""The engine's actors at niceness 0, the cheap way where the machine allows.

Ray starts worker processes at nice 15 so that its own daemons win any
contention. The engine's actors are the latency path: at 15 a rank's OpenMP
thread loses its core to the engine loop or raylet mid-forward
(docs/BENCHMARKS_HISTORY.md, worker niceness).

Ray's own way to start a worker at 0 is a runtime environment
(`RAY_worker_niceness=0`), and a worker with any runtime environment starts
through Ray's setup process, which imports Ray once more before the worker
itself does: every actor of an engine start or restart pays that import
(docs/BENCHMARKS.md, engine start). Where a process may lower its niceness
(root with CAP_SYS_NICE, or an RLIMIT_NICE that allows 0), the actor lowers
its own threads to 0 as it starts instead, and needs no runtime environment.
Niceness is per thread on Linux: every thread there is lowered, and the
threads it starts later (torch's) inherit 0.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

import ray

logger = logging.getLogger(__name__)

HOT_PATH_RUNTIME_ENV: dict[str, Any] = {"env_vars": {"RAY_worker_niceness": "0"}}
# How long a replica's start waits for each Serve proxy to lower itself.
PROXY_CALL_TIMEOUT_S = 10.0


@functools.cache
def may_lower_niceness() -> bool:
    """Whether this process may lower a thread's niceness: a throwaway
    thread raises its own by one and lowers it back."""
    allowed: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        high = max(os.getpriority(os.PRIO_PROCESS, tid), 1)  # so that one lower is still 0 or more
        os.setpriority(os.PRIO_PROCESS, tid, high)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, high - 1)
            allowed.append(True)
        except PermissionError:
            allowed.append(False)

    thread = threading.Thread(target=probe, name="niceness-probe")
    thread.start()
    thread.join()
    return allowed == [True]


def rank_runtime_env(user_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """The runtime environment of an engine actor (or a batch job's engine
    replica) made from this process: `user_env` as given where the actor can
    lower its own niceness (`lower_to_zero`), since the actors of one engine
    run as one user on like nodes; else with Ray's niceness setting added
    (the user's own variables win)."""
    env = dict(user_env or {})
    if not may_lower_niceness():
        env["env_vars"] = {**HOT_PATH_RUNTIME_ENV["env_vars"], **env.get("env_vars", {})}
    return env


def lower_to_zero() -> None:
    """Every thread of this process at niceness 0 (an engine actor's first
    act, and Serve's proxy's at a replica's request: `lower_serve_proxies`);
    where the process may not, it stays where Ray put it, logged."""
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except PermissionError:
            logger.warning("this process may not lower its niceness; it runs at %d",
                           os.getpriority(os.PRIO_PROCESS, 0))
            return


def _lower_this_proxy(_proxy: object) -> bool:
    """Run in a Serve proxy (its `__ray_call__`): its threads at 0 where allowed."""
    if not may_lower_niceness():
        return False
    lower_to_zero()
    return True


def lower_serve_proxies() -> None:
    """Serve's HTTP proxies (every one running now) at niceness 0, each
    lowering its own threads where its process may (a warning names each
    that does not).

    Every request and streamed chunk that comes through a proxy crosses it
    (all of them without direct ingress; with it, those sent to the proxy's
    port, which the launcher configs document), and Ray starts it at 15 like
    any worker: on a node whose cores the forward keeps busy it then waits
    behind every process at 0 (the replica, the engine, Ray's daemons) for a
    core (docs/BENCHMARKS.md, the proxy path). Every replica calls this as it
    starts; a proxy that Serve starts or restarts later stays at 15 (an idle
    proxy wakes as often at either niceness)."""
    # Here, not at the top: the engine's actors import this module and never Serve.
    from ray.serve._private.constants import SERVE_NAMESPACE, SERVE_PROXY_NAME

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(SERVE_PROXY_NAME)]
    calls: dict[str, ray.ObjectRef] = {}
    for name in names:
        try:
            calls[name] = ray.get_actor(name, namespace=SERVE_NAMESPACE).__ray_call__.remote(_lower_this_proxy)
        except ValueError:
            continue  # gone since it was listed
    for name, ref in calls.items():
        try:
            if not ray.get(ref, timeout=PROXY_CALL_TIMEOUT_S):
                logger.warning("Serve's proxy %s may not lower its niceness; it stays at Ray's", name)
        except (ray.exceptions.RayError, TimeoutError) as e:
            logger.warning("Serve's proxy %s was not lowered to niceness 0: %s", name, e)
