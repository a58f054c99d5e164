"""Two Serve replicas with adapters. Serve's model multiplexing sends every
request for an adapter to the replica that served it first (each replica
reports the adapters it serves), so that replica's prefix cache under the
adapter keeps hitting; the other replica never loads it.

And Serve owns the engine's resources (issue 15): each LLMServer replica's
worker bundles are reserved with it (`placement_group_bundles`), its
SchedulerActor runs inside them, and a killed replica's group, actors and
all, is removed when Serve replaces it; deleting the app leaves no
placement group and no engine actor."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402
from ray.serve._private.common import DeploymentID  # noqa: E402
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: E402

from rayvllm import SamplingParams  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.entrypoints.openai.api_server import LLMServer  # noqa: E402
from rayvllm.entrypoints.serve_builder import replica_placement  # noqa: E402

import ray_state  # noqa: E402
from hf_oracle import NUM_NEW  # noqa: E402
from lora_oracle import build_adapter, peft_greedy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
APP = "mux"
DEADLINE_S = 240.0
ENGINE_ACTORS = ("SchedulerActor", "WorkerActor")
REPLICA = f"ServeReplica:{APP}:LLMServer"


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tiny_model_dir, tmp_path_factory.mktemp("mux") / "a", seed=31, rank=8)


@pytest.fixture(scope="module")
def others(serve_local: None) -> set[str]:
    """On the shared cluster: the ids of the placement groups and actors
    alive before this module's app, which are not its own."""
    return set(_live_groups(set())) | {a.actor_id for a in _alive(ENGINE_ACTORS + (REPLICA,), set())}


@pytest.fixture(scope="module")
def two_replicas(
    others: set[str], tiny_model_dir: Path, adapter: Path
) -> Iterator[serve.handle.DeploymentHandle]:
    """The handle's router runs in this process. Serve sends a request for
    an adapter to another replica when the one holding it has not taken the
    request within 1-2 s (its matching timeout), which a loaded 2-core
    machine can exceed; the test is about where requests go when that
    replica answers, so the window is widened here."""
    from ray.serve._private.request_router import request_router

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_router, "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S", 30.0)
        yield from _two_replicas(tiny_model_dir, adapter)
    # Deleting the app leaves none of its groups and engine actors.
    _wait_for("every group to be removed", lambda: not _live_groups(others))
    _wait_for("every engine actor to end", lambda: not _alive(ENGINE_ACTORS, others))


def _two_replicas(tiny_model_dir: Path, adapter: Path) -> Iterator[serve.handle.DeploymentHandle]:
    try:
        args = dict(model=str(tiny_model_dir), enable_lora=True, max_loras=1, max_lora_rank=16, max_num_seqs=4,
                    max_model_len=256, kv_cache_memory_bytes=8 << 20)
        # Serve finds a killed replica at its next health check: soon, here.
        app = LLMServer.options(  # type: ignore[attr-defined]
            num_replicas=2, health_check_period_s=1, **replica_placement(EngineArgs(**args))
        ).bind(args, lora_modules=[f"a={adapter}"])
        yield serve.run(app, name=APP, route_prefix=None)
    finally:
        serve.delete(APP)


def _live_groups(others: set[str]) -> dict[str, int]:
    """Placement groups not removed and not in `others`: id -> bundle count."""
    return {pg_id: size for pg_id, size in ray_state.live_placement_group_sizes().items() if pg_id not in others}


def _alive(names: tuple[str, ...], others: set[str]) -> list[ray_state.ActorState]:
    return [a for a in ray_state.actors(state="ALIVE") if a.class_name in names and a.actor_id not in others]


def _wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)  # polling the cluster's state, which changes on its own


def _complete(handle: serve.handle.DeploymentHandle) -> list[int]:
    out = handle.generate.remote("Hello", {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}).result()
    return list(out.outputs[0].token_ids)


def _replicas_serving(model_id: str) -> list[str]:
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    states = ray.get(controller._dump_replica_states_for_testing.remote(DeploymentID("LLMServer", APP)))
    return [str(r.replica_id) for r in states.get() if model_id in r.multiplexed_model_ids]


def _router_serving(handle: serve.handle.DeploymentHandle, model_id: str) -> bool:
    """This process's router for `handle` knows a replica serving
    `model_id` (Ray 2.60's internals; the version is pinned)."""
    router = handle._router._asyncio_router.request_router  # type: ignore[union-attr]
    return router is not None and bool(router._multiplexed_model_id_to_replica_ids.get(model_id))


def test_requests_for_an_adapter_stay_on_its_replica(
    two_replicas: serve.handle.DeploymentHandle, tiny_model_dir: Path, adapter: Path
) -> None:
    handle = two_replicas.options(multiplexed_model_id="a")
    rng = random.Random(9)

    def prompt() -> list[int]:
        return [rng.randrange(5, 4000) for _ in range(40)]

    first = prompt()
    out = handle.generate.remote({"prompt_token_ids": first}, GREEDY).result()
    assert out.outputs[0].token_ids == peft_greedy(tiny_model_dir, adapter, first)
    # The replica's report reaches the controller, then this handle's
    # router; until the router has it, a request for "a" may go to either
    # replica (which then loads it too). Wait for both.
    deadline = time.monotonic() + 60
    while not (_replicas_serving("a") and _router_serving(handle, "a")):
        assert time.monotonic() < deadline, "no replica reported adapter a"
        time.sleep(0.2)  # polling the controller's state, not synchronisation
    # Each fresh prompt twice: the second hits the prefix cache only on the same replica.
    for _ in range(6):
        ids = prompt()
        handle.generate.remote({"prompt_token_ids": ids}, GREEDY).result()
        again = handle.generate.remote({"prompt_token_ids": ids}, GREEDY).result()
        assert again.num_cached_tokens >= 32
        assert again.outputs[0].token_ids == peft_greedy(tiny_model_dir, adapter, ids)
    assert len(_replicas_serving("a")) == 1


def test_two_replicas_own_their_groups_and_a_killed_one_leaks_nothing(
    two_replicas: serve.handle.DeploymentHandle, others: set[str]
) -> None:
    """Plain requests (no adapter), so the multiplexing test above holds
    whether this one runs before it or after."""
    expected = _complete(two_replicas)
    assert len(expected) == 3
    groups = _live_groups(others)
    # One group per replica: the replica's bundle plus one worker bundle,
    # where the SchedulerActor runs the model itself (world size 1).
    assert sorted(groups.values()) == [2, 2]
    assert Counter(a.class_name for a in _alive(ENGINE_ACTORS, others)) == {"SchedulerActor": 2}

    victim = next(a for a in _alive((REPLICA,), others))
    os.kill(victim.pid, signal.SIGKILL)
    _wait_for("the killed replica's group to go", lambda: len(set(_live_groups(others)) & set(groups)) == 1)
    _wait_for("Serve to replace the replica",
              lambda: len(_live_groups(others)) == 2 and len(_alive(ENGINE_ACTORS, others)) == 2)
    # The replacement serves the same tokens.
    _wait_for("a healthy app", lambda: serve.status().applications[APP].status == "RUNNING")
    assert _complete(two_replicas) == expected
