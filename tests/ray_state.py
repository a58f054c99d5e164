"""The connected cluster's actors and placement groups as its GCS holds them:
what `ray.util.state` lists, without the dashboard that API goes through.
The test clusters start no dashboard: its head and modules cost each cluster
seconds of CPU to start and a steady share of a core while it lives, on the
two cores the whole suite shares. (Ray's private GCS accessor; the Ray
version is pinned in pyproject.toml.)"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray._private.state import state as _global_state
from ray.core.generated import gcs_pb2


@dataclass(frozen=True)
class ActorState:
    actor_id: str
    class_name: str
    repr_name: str  # what the actor's __repr__ said, e.g. "WorkerActor(rank=1)"
    name: str
    state: str  # "ALIVE", "DEAD", "PENDING_CREATION", ...
    pid: int
    node_id: str
    placement_group_id: str  # "" outside a group
    required_resources: dict[str, float]


def _parse(raw: bytes) -> ActorState:
    data = gcs_pb2.ActorTableData.FromString(raw)
    return ActorState(
        actor_id=data.actor_id.hex(),
        class_name=data.class_name,
        repr_name=data.repr_name,
        name=data.name,
        state=gcs_pb2.ActorTableData.ActorState.Name(data.state),
        pid=data.pid,
        node_id=data.address.node_id.hex(),
        placement_group_id=data.placement_group_id.hex(),
        required_resources=dict(data.required_resources),
    )


def actors(class_name: str | None = None, state: str | None = None) -> list[ActorState]:
    """The cluster's actors (all jobs'), of `class_name` and in `state` where given."""
    table = _global_state._connect_and_get_accessor().get_actor_table(None, state)
    found = [_parse(raw) for raw in table]
    return [a for a in found if class_name is None or a.class_name == class_name]


def actor(actor_id: str) -> ActorState:
    raw = _global_state._connect_and_get_accessor().get_actor_info(ray.ActorID.from_hex(actor_id))
    assert raw is not None, f"no actor {actor_id}"
    return _parse(raw)


def _live_group_table() -> dict[str, dict]:
    return {gid: g for gid, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}


def live_placement_groups() -> dict[str, str]:
    """Placement group id -> name, of the groups not removed."""
    return {gid: g["name"] for gid, g in _live_group_table().items()}


def live_placement_group_sizes() -> dict[str, int]:
    """Placement group id -> its number of bundles, of the groups not removed."""
    return {gid: len(g["bundles"]) for gid, g in _live_group_table().items()}
