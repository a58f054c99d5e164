"""Shared pytest fixtures.

Keep this file to fixtures that several test modules need; a fixture used by
one module belongs in that module. Expensive fixtures are session-scoped and
build into pytest's tmp dirs, never into the repository.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# A Python told not to cache bytecode (PYTHONDONTWRITEBYTECODE, as some
# sandboxes and CI machines are) compiles the package's modules again in
# every process the suite starts: each Ray worker, replica and server, a few
# hundred in a run. Python's default caches them (in the checkout's ignored
# __pycache__ folders), as a user's install does; pytest's assertion
# rewriting caches the test modules the same way.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# Two xdist workers share the cores (pyproject.toml's addopts): an OpenMP
# thread that spins for work when idle takes its core from the other
# worker's processes. libgomp reads this as torch loads it; Ray's
# processes and the servers tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The engines tests start hold a few thousand tokens at most; the CPU
# default (2 GiB, or what max_num_seqs full sequences need: 0.5-1 GiB for
# the tiny and demo models) is written through at every engine start and
# held by every rank. Ray's processes and the servers tests start inherit
# it; tests of the default budget unset it. (rayvllm.config imports
# neither torch nor the kernels.)
from rayvllm.config import CPU_KV_CACHE_SPACE_ENV  # noqa: E402

os.environ.setdefault(CPU_KV_CACHE_SPACE_ENV, "0.125")

import torch  # noqa: E402

# Counts the Ray clusters and Serve apps a session starts (printed with the summary).
pytest_plugins = ["session_counts", "xdist_groups"]

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter. `@triton.jit`
    # reads the variable when it decorates, i.e. when a kernel module is first
    # imported, and conftest is imported before any test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from serve_harness import ServeProcess, SharedServe, app_name  # noqa: E402  (after TRITON_INTERPRET: it imports rayvllm)
from item_scopes import module_of, uses_shared  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# The test session's one local Ray cluster (see `ray_local`). More logical
# CPUs than cores: every engine rank asks for one, and their torch threads
# are sized to the real cores. No dashboard: tests read actors and groups
# from the GCS (ray_state.py). The driver joins Serve's namespace (as
# `serve run` does), where a test finds Serve's controller; engine actors
# name their own namespaces. Processes report their metrics on Ray's own
# period (10 s): a shorter one costs every process of the cluster CPU for
# the one test that reads them.
RAY_LOCAL_INIT: dict[str, object] = dict(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)


def _poll_serve_faster() -> None:
    """Serve's client (`serve.run`, `serve.delete` in this process) checks
    an app's state once a second, a fixed constant; a test waits on it a
    dozen times. Its controller updates that state every 0.1 s, which is
    how often the client asks here."""
    from ray.serve._private import client

    client.CLIENT_POLLING_INTERVAL_S = 0.1


class SharedRay:
    """The local Ray cluster that the modules using `ray_local` share,
    started on first use. Invariant: while `up`, this process is connected
    to it and to no other cluster; `close` shuts it (and Serve, if a test
    started it there) down, after which the next `connect` starts a fresh one."""

    def __init__(self) -> None:
        self.up = False
        self.serve_up = False
        self.proxy_url = ""

    def connect(self) -> None:
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        if self.up:
            return
        assert not ray.is_initialized(), "a test left its own Ray connection open"
        ray.init(**RAY_LOCAL_INIT, namespace=SERVE_NAMESPACE)
        _poll_serve_faster()
        self.up = True

    def start_serve(self) -> None:
        """Serve on this cluster, its proxy on a free port (Serve's default,
        8000, may belong to anyone on the machine)."""
        from ray import serve

        from rayvllm.utils.network import free_port

        self.connect()
        if not self.serve_up:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            self.serve_up = True
            self.proxy_url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        if self.serve_up:
            from ray import serve

            serve.shutdown()  # also forgets this process's handle on the controller
            self.serve_up = False
        if self.up:
            import ray

            ray.shutdown()
            self.up = False


_SHARED_RAY = SharedRay()
_SHARED_SERVE = SharedServe()
# Modules (by path) that use each shared thing, by its fixture's name; and
# the shared server's apps: app name -> the module that defines its args.
_USERS = pytest.StashKey[dict[str, set[str]]]()
_SERVE_APPS = pytest.StashKey[dict[str, pytest.Module]]()


_SHARED = {"ray_local": _SHARED_RAY, "serve_apps": _SHARED_SERVE}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that use the shared cluster run first, then those that
    use the shared server, each group one module after another, so each
    starts once; the rest keep their order after them. Whole modules move,
    so module-scoped fixtures still set up once."""
    users = {name: {module_of(item) for item in items if uses_shared(item, name)} for name in _SHARED}
    items.sort(key=lambda item: [module_of(item) not in users[name] for name in _SHARED])
    config.stash[_USERS] = users
    config.stash[_SERVE_APPS] = {
        app_name(str(item.path)): item.module for item in items
        if uses_shared(item, "serve_apps") and isinstance(item, pytest.Function)
        and hasattr(item.module, "serve_app_args")
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last module that uses a shared cluster or server (its
    fixtures torn down), stop it: the tests after it start their own."""
    yield
    for name, shared in _SHARED.items():
        if nextitem is None or module_of(nextitem) not in item.config.stash[_USERS][name]:
            shared.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for shared in _SHARED.values():
        shared.close()  # after an interrupted run too


@pytest.fixture(scope="module")
def ray_local() -> None:
    """This process connected to the session's shared local Ray cluster
    (`RAY_LOCAL_INIT`). A test that uses it stops every actor, placement
    group and Serve app it starts, and kills only what it started (its own
    engine's processes); a test that needs a cluster of its own (other
    `ray.init` options, a multi-node `Cluster`, job-wide hooks) uses
    `ray_private` instead."""
    _SHARED_RAY.connect()


@pytest.fixture(scope="module")
def serve_local(ray_local: None) -> str:
    """Serve running on the shared cluster; the URL of its proxy (on a free
    port). A test deletes the apps it runs (`serve.delete`); Serve itself
    stays up for the next module."""
    _SHARED_RAY.start_serve()
    return _SHARED_RAY.proxy_url


@pytest.fixture(scope="module")
def serve_apps(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    """The session's shared `serve run` (returned) is up: the shipped serve_config.yaml's
    apps, and one app per module of this session that uses this fixture and
    defines `serve_app_args(request)`: the app that describes, answering at
    `app_url(__file__)` (Serve's proxy, on a free port). The apps are independent engines;
    a test that needs a server of its own (one it kills, Serve's direct
    ingress, the README's commands) starts one (serve_harness.serve_run)."""
    if _SHARED_SERVE.proc is None:
        modules = request.config.stash[_SERVE_APPS]
        apps = {name: module.serve_app_args(request) for name, module in modules.items()}
        _SHARED_SERVE.start(apps, tmp_path_factory.mktemp("shared-serve"))
    assert _SHARED_SERVE.proc is not None
    return _SHARED_SERVE.proc


@pytest.fixture(scope="session")
def lora_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four PEFT adapters of `tiny_model_dir` (a, b, c, wide: ranks 8, 4, 8,
    32 over different modules), built once: the shared server loads some of
    them at its start. Treat them as read-only."""
    from lora_oracle import build_adapter

    root = tmp_path_factory.mktemp("serve-adapters")
    return {
        "a": build_adapter(tiny_model_dir, root / "a", seed=21, rank=8),
        "b": build_adapter(tiny_model_dir, root / "b", seed=22, rank=4, targets=("q_proj", "v_proj")),
        "c": build_adapter(tiny_model_dir, root / "c", seed=23, rank=8, targets=("o_proj", "down_proj")),
        "wide": build_adapter(tiny_model_dir, root / "wide", seed=24, rank=32),
    }


@pytest.fixture(scope="module")
def ray_private() -> None:
    """No shared cluster connected: the module starts (`ray.init(address="local", ...)`
    or a `ray.cluster_utils.Cluster`) and shuts down a cluster of its own."""
    _SHARED_RAY.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with the default `RandomModelSpec` (vocab 4096, ids 0..4
    are <unk>, <s>, </s>, <|im_start|>, <|im_end|>; chat template included),
    built once per test session. Treat it as read-only."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    return build_random_model(tmp_path_factory.mktemp("tiny_model"), RandomModelSpec())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> "PreTrainedTokenizerBase":
    """The fast tokenizer of `tiny_model_dir`, loaded once. Do not mutate it
    (use monkeypatch for temporary attribute changes)."""
    from rayvllm.utils.tokenizer import get_tokenizer

    return get_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def no_ray_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """This environment plus a `ray` package that cannot be imported, first
    on PYTHONPATH: a script run with it, and its children, see no Ray, as on
    the GPU benchmark machine."""
    fake = tmp_path_factory.mktemp("no_ray") / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("ray is blocked in this test")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(fake.parent), env.get("PYTHONPATH", "")) if p)
    return env


def _damped_model(base: Path, path: Path, scale: float) -> Path:
    """`base` with its last layer's residual contributions scaled by
    `scale`: a draft cut from its other layers then agrees with it often,
    but not always, which is what a test of acceptance and rejection wants."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        last = model.model.layers[-1]
        last.self_attn.o_proj.weight.mul_(scale)
        last.mlp.down_proj.weight.mul_(scale)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def draft_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft) for speculative decoding: a 2-layer random Llama
    (its second layer damped) and the 1-layer draft cut from it, sharing
    the tokenizer. Treat both as read-only."""
    from rayvllm.models.truncated_draft import build_truncated_draft
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    root = tmp_path_factory.mktemp("spec_models")
    base = build_random_model(root / "base", RandomModelSpec(num_hidden_layers=2, seed=31))
    target = _damped_model(base, root / "target", 0.1)
    return target, build_truncated_draft(target, root / "draft", 1)
