"""A pytest plugin (loaded by conftest) that counts the expensive things a
test session starts, and prints them with the summary: the Ray clusters
(begun in a pytest process, by `ray.init` or a `ray.cluster_utils.Cluster`
head, or by a server subprocess: `serve run`, `rayvllm serve`, `ray up`)
and the Serve applications (`serve.run` here, or the apps a server
subprocess deploys). The suite's wall time is mostly these starts. Under
pytest-xdist each worker counts its own and the controller prints the sum."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

_COUNTS: Counter[str] = Counter()


def _config_apps(argv: list[str], cwd: object) -> int:
    """Applications a `serve run <config file>` deploys (1 for an import path)."""
    import yaml

    path = next((a for a in argv[2:] if not a.startswith("-")), "")
    if not path.endswith((".yaml", ".yml")):
        return 1
    return len(yaml.safe_load((Path(str(cwd or ".")) / path).read_text()).get("applications", []))


def _count_subprocess(argv: object, cwd: object) -> None:
    if not isinstance(argv, (list, tuple)) or not argv:
        return
    args = [str(a) for a in argv]
    name = Path(args[0]).name
    if name == "serve" and args[1:2] == ["run"]:
        _COUNTS["ray clusters (server subprocesses)"] += 1
        _COUNTS["serve apps (server subprocesses)"] += _config_apps(args, cwd)
    elif name == "rayvllm" and "serve" in args:
        _COUNTS["ray clusters (server subprocesses)"] += 1
        _COUNTS["serve apps (server subprocesses)"] += 1
    elif name == "ray" and args[1:2] == ["up"]:
        # The cluster file's head commands `serve deploy` one app.
        _COUNTS["ray clusters (server subprocesses)"] += 1
        _COUNTS["serve apps (server subprocesses)"] += 1


def pytest_configure(config: pytest.Config) -> None:
    try:
        from ray import serve
        from ray._private import node
    except ImportError:
        return  # no Ray on this machine (the GPU proof's): no cluster to count

    start_node = node.Node.__init__
    run_app = serve.run
    popen = subprocess.Popen.__init__

    def counting_node(self: Any, ray_params: Any, head: bool = False, *args: Any, **kwargs: Any) -> None:
        if head and not kwargs.get("connect_only", False):
            _COUNTS["ray clusters (pytest processes)"] += 1
        start_node(self, ray_params, head, *args, **kwargs)

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        _COUNTS["serve apps (pytest processes)"] += 1
        return run_app(*args, **kwargs)

    def counting_popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        _count_subprocess(args, kwargs.get("cwd"))
        popen(self, args, *rest, **kwargs)

    node.Node.__init__ = counting_node  # type: ignore[method-assign]
    serve.run = counting_run
    subprocess.Popen.__init__ = counting_popen  # type: ignore[method-assign]


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller prints the sum
        workeroutput["session_counts"] = dict(_COUNTS)


@pytest.hookimpl(optionalhook=True)  # pytest without xdist has no such hook
def pytest_testnodedown(node: Any, error: object) -> None:
    _COUNTS.update(getattr(node, "workeroutput", {}).get("session_counts", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _COUNTS:
        terminalreporter.write_sep("-", "started by this session")
        for what, n in sorted(_COUNTS.items()):
            terminalreporter.write_line(f"{what}: {n}")
