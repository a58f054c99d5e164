"""Serve owns the engine's resources (issue 15): each LLMServer replica's
worker bundles are reserved with it (`placement_group_bundles`), its
SchedulerActor and WorkerActors run inside them, and a killed replica's
group, actors and all, is removed when Serve replaces it; deleting the app
leaves no placement group and no engine actor."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from rayvllm.entrypoints.openai.api_server import LLMServer  # noqa: E402
from rayvllm.entrypoints.serve_builder import replica_placement, split_args  # noqa: E402

APP = "placement-test"
ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 4}
DEADLINE_S = 240.0
ENGINE_ACTORS = ("SchedulerActor", "WorkerActor")
REPLICA = f"ServeReplica:{APP}:LLMServer"


@pytest.fixture()
def others(serve_local: None) -> Iterator[set[str]]:
    """On the shared cluster (two replicas each reserve a byte of memory and one worker
    CPU of its logical CPUs): the ids of the placement groups and actors
    alive before the test, which are not its own. Deletes the app after."""
    try:
        yield set(_live_groups(set())) | {a["ActorID"] for a in _alive(ENGINE_ACTORS + (REPLICA,), set())}
    finally:
        serve.delete(APP)


def _live_groups(others: set[str]) -> dict[str, int]:
    """Placement groups not removed and not in `others`: id -> bundle count."""
    table = placement_group_table()
    return {
        pg_id: len(info["bundles"])
        for pg_id, info in table.items()
        if info["state"] != "REMOVED" and pg_id not in others
    }


def _alive(names: tuple[str, ...], others: set[str]) -> list[dict[str, Any]]:
    return [
        a for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"] in names and a["ActorID"] not in others
    ]


def _wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)  # polling the cluster's state, which changes on its own


def _complete(handle: Any) -> list[int]:
    out = handle.generate.remote("Hello", {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}).result()
    return list(out.outputs[0].token_ids)


def test_two_replicas_own_their_groups_and_a_killed_one_leaks_nothing(others: set[str], tiny_model_dir: Path) -> None:
    engine, _ = split_args({"model": str(tiny_model_dir), **ENGINE_ARGS})
    # Serve finds the killed replica at its next health check: soon, here.
    app = LLMServer.options(  # type: ignore[attr-defined]
        num_replicas=2, health_check_period_s=1, **replica_placement(engine)
    ).bind(engine.model_dump(exclude_unset=True))
    handle = serve.run(app, name=APP, route_prefix=None)
    expected = _complete(handle)
    assert len(expected) == 3

    groups = _live_groups(others)
    # One group per replica: the replica's bundle plus one worker bundle,
    # where the SchedulerActor runs the model itself (world size 1).
    assert sorted(groups.values()) == [2, 2]
    assert Counter(a["ActorClassName"] for a in _alive(ENGINE_ACTORS, others)) == {"SchedulerActor": 2}

    victim = next(a for a in _alive((REPLICA,), others))
    os.kill(victim["Pid"], signal.SIGKILL)
    _wait_for("the killed replica's group to go", lambda: len(set(_live_groups(others)) & set(groups)) == 1)
    _wait_for("Serve to replace the replica", lambda: len(_live_groups(others)) == 2 and len(_alive(ENGINE_ACTORS, others)) == 2)
    # The replacement serves the same tokens.
    _wait_for("a healthy app", lambda: serve.status().applications[APP].status == "RUNNING")
    assert _complete(handle) == expected

    serve.delete(APP)
    _wait_for("every group to be removed", lambda: not _live_groups(others))
    _wait_for("every engine actor to end", lambda: not _alive(ENGINE_ACTORS, others))
