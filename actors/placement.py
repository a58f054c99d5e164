"""Ray placement of one worker group (TP x PP ranks of one data-parallel rank).

One placement group per worker group, one bundle per rank. Global rank
``r = pp_rank * tp_size + tp_rank``; ranks are handed out node by node, so a
tensor-parallel group (ranks ``pp*tp .. pp*tp+tp-1``) always shares a node and
only pipeline stages cross nodes.

Invariants of a returned ``(pg, placements)``:
- ``placements[r].rank == r`` for every rank, ``len(placements) == world_size``;
- every bundle index appears exactly once;
- all ranks of one TP group have the same ``node_id``;
- the driver's node (if it holds bundles) comes first, then nodes ordered by
  (ip, node id), so the mapping is deterministic for a given bundle layout.

A group that cannot be placed fails with ``PlacementError`` after
``placement_group_timeout_s`` and leaves no placement group behind.

This module imports Ray: keep it out of the import-time graph of the Ray-free
core (``rayvllm.core``, ``rayvllm.engine``, ``rayvllm.worker``).
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayvllm.actors.niceness import rank_runtime_env
from rayvllm.config import ParallelConfig
from rayvllm.messages.errors import InvalidParameterError, PlacementError

Bundle = dict[str, float]


@dataclass(frozen=True)
class RankPlacement:
    """Where one global rank runs: bundle ``bundle_index`` of the group's
    placement group, which Ray reserved on node ``node_id`` (at ``node_ip``)."""

    rank: int
    bundle_index: int
    node_id: str
    node_ip: str


def worker_bundles(parallel_config: ParallelConfig, device: str) -> list[Bundle]:
    """One bundle per rank of a worker group, shaped by the device.

    GPU ranks reserve exactly one GPU and no CPU, so a small machine can still
    host the scheduler and Serve beside them (docs/ARCHITECTURE.md, principle 8)."""
    kind = device.split(":", 1)[0]
    if kind == "cuda":
        bundle: Bundle = {"GPU": 1.0}
    elif kind == "cpu":
        bundle = {"CPU": float(parallel_config.num_cpus_per_worker)}
    else:
        raise InvalidParameterError("device", f"must be 'cpu' or 'cuda', got {device!r}")
    return [dict(bundle) for _ in range(parallel_config.world_size)]


# The Serve replica's own bundle, first in its placement group: the replica
# asks for no CPU (its work is the event loop), but a bundle must hold some
# resource. A byte of memory, not a sliver of CPU: N replicas of one CPU rank
# each then fit a node of N cores (two on a 2-core machine).
REPLICA_BUNDLE: Bundle = {"memory": 1.0}


def deployment_bundles(parallel_config: ParallelConfig, device: str) -> list[Bundle]:
    """Serve's `placement_group_bundles` for one replica: the replica's own
    bundle, then one worker group per data-parallel rank (DP rank d has
    bundles 1 + d * world_size ..). Serve reserves them with the replica and
    removes them with it, so a replaced or scaled-down replica leaves no group
    behind, and the scheduler actor and workers are placed in them
    (`replica_bundles`)."""
    groups = worker_bundles(parallel_config, device) * parallel_config.data_parallel_size
    return [dict(REPLICA_BUNDLE)] + groups


@dataclass(frozen=True)
class ReservedBundles:
    """Bundles of a placement group that the engine did not make and never
    removes: a Serve replica's (`replica_bundles`) or a caller's, such as an
    RL trainer that colocates the engine's workers with its own
    (`caller_bundles`). `worker_bundles`: one per rank, DP rank d's ranks at
    `[d * world_size, (d + 1) * world_size)`; `scheduler_bundle`: where the
    SchedulerActor sits when it hosts no worker (None: beside the caller,
    asking for no CPU)."""

    pg: PlacementGroup
    worker_bundles: tuple[int, ...]
    scheduler_bundle: int | None = None


def replica_bundles(pg: PlacementGroup, parallel_config: ParallelConfig) -> ReservedBundles:
    """A Serve replica's group, laid out by `deployment_bundles`."""
    count = parallel_config.world_size * parallel_config.data_parallel_size
    if pg.bundle_count != 1 + count:
        raise PlacementError(
            f"the replica's placement group has {pg.bundle_count} bundles; tensor x pipeline x data "
            f"parallel sizes need {1 + count} (deployment_bundles)"
        )
    return ReservedBundles(pg, tuple(range(1, 1 + count)), scheduler_bundle=0)


def caller_bundles(
    pg: PlacementGroup, parallel_config: ParallelConfig, device: str, indices: Sequence[int] | None
) -> ReservedBundles:
    """A caller's group: `indices` name the bundle of each rank (DP-rank
    major, as `ReservedBundles` says; default: the first bundles in order).
    Each must exist once and hold what a rank asks for (`worker_bundles`)."""
    count = parallel_config.world_size * parallel_config.data_parallel_size
    chosen = tuple(range(count)) if indices is None else tuple(indices)
    field = "placement_group_bundle_indices"
    if len(chosen) != count:
        raise InvalidParameterError(
            field, f"needs one bundle per rank: {count} (tensor x pipeline x data parallel sizes), got {len(chosen)}"
        )
    if len(set(chosen)) != count:
        raise InvalidParameterError(field, f"names a bundle twice: {list(chosen)}")
    specs = pg.bundle_specs
    ask = worker_bundles(parallel_config, device)[0]
    for index in chosen:
        if not 0 <= index < len(specs):
            raise InvalidParameterError(field, f"bundle {index} is not in the group's {len(specs)} bundles")
        short = {k: v for k, v in ask.items() if specs[index].get(k, 0.0) < v}
        if short:
            raise InvalidParameterError(field, f"bundle {index} holds {specs[index]}; a rank needs {ask}")
    return ReservedBundles(pg, chosen)


def reserved_worker_placements(
    reserved: ReservedBundles, parallel_config: ParallelConfig, dp_rank: int
) -> list[RankPlacement]:
    """DP rank `dp_rank`'s ranks in `reserved`'s bundles, a TP group on one node."""
    world = parallel_config.world_size
    pg = reserved.pg
    ready, _ = ray.wait([pg.ready()], timeout=parallel_config.placement_group_timeout_s)
    if not ready:
        timeout = parallel_config.placement_group_timeout_s
        raise PlacementError(f"the reserved placement group was not ready in {timeout:g}s")
    indices = reserved.worker_bundles[dp_rank * world : (dp_rank + 1) * world]
    all_nodes = _bundle_nodes(pg, pg.bundle_count)
    placements = assign_ranks(
        bundle_nodes=[all_nodes[i] for i in indices],
        node_ips=_node_ips(),
        driver_node_id=ray.get_runtime_context().get_node_id(),
        tp_size=parallel_config.tensor_parallel_size,
        pp_size=parallel_config.pipeline_parallel_size,
    )
    return [RankPlacement(p.rank, indices[p.bundle_index], p.node_id, p.node_ip) for p in placements]


def create_worker_placement_group(
    parallel_config: ParallelConfig, device: str, name: str,
    pending: PlacementGroup | None = None, keep_on_timeout: bool = False,
) -> tuple[PlacementGroup, list[RankPlacement]]:
    """Reserve one worker group and map its ranks to bundles.

    Waits at most ``placement_group_timeout_s``; on timeout or on a layout
    that splits a TP group across nodes, ``PlacementError`` names what was
    asked for and what the cluster has. The group is removed on timeout,
    unless `keep_on_timeout`: then the error's `pending_group` holds it,
    for the caller's next try to wait on again (`pending`) instead of
    making one: one steady demand for an autoscaler while a restart waits
    for room, and no removal racing Ray's placement of it (a group removed
    just as a joining node took its bundles left that node's CPUs reserved
    for good)."""
    bundles = worker_bundles(parallel_config, device)
    strategy = parallel_config.placement_group_strategy
    timeout_s = parallel_config.placement_group_timeout_s
    pg = pending if pending is not None else placement_group(bundles, strategy=strategy, name=name)
    # ray.wait with a timeout, never a bare ray.get: an unplaceable group must
    # fail loudly instead of hanging the engine start.
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        error = PlacementError(
            f"placement group {name!r} was not placed within {timeout_s:g}s: "
            f"{_describe_request(bundles, strategy)}; {_describe_cluster(bundles, strategy)}"
        )
        if keep_on_timeout:
            error.pending_group = pg
        else:
            remove_placement_group(pg)
        raise error
    try:
        placements = assign_ranks(
            bundle_nodes=_bundle_nodes(pg, len(bundles)),
            node_ips=_node_ips(),
            driver_node_id=ray.get_runtime_context().get_node_id(),
            tp_size=parallel_config.tensor_parallel_size,
            pp_size=parallel_config.pipeline_parallel_size,
        )
    except BaseException:
        remove_placement_group(pg)
        raise
    return pg, placements


def remove_worker_placement_group(pg: PlacementGroup) -> None:
    """Release the group's reservation; actors scheduled into it are killed."""
    remove_placement_group(pg)


def worker_group_name(dp_rank: int) -> str:
    """The name of DP rank `dp_rank`'s worker placement group, made after
    the actor that creates it (the SchedulerActor): Ray does not remove a
    group when the actor that made it dies, so its client removes what
    that actor left (`remove_groups_made_by`)."""
    owner = ray.get_runtime_context().get_actor_id() or uuid.uuid4().hex
    return f"rayvllm-dp{dp_rank}-{owner}"


def remove_groups_made_by(actor_id: str) -> None:
    """Remove the worker placement groups actor `actor_id` made and left."""
    for info in ray.util.placement_group_table().values():
        if info["name"].endswith(f"-{actor_id}") and info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(info["placement_group_id"]))))


def scheduler_actor_options(
    parallel_config: ParallelConfig, device: str, reserved: ReservedBundles | None,
    pending: PlacementGroup | None = None,
) -> tuple[dict[str, Any], PlacementGroup | None]:
    """``SchedulerActor.options(**...)``, and the placement group made for it
    (None if none was; the caller removes it at shutdown). A group that is
    not placed in time stays, in the `PlacementError`, for the caller to
    pass back as `pending` or remove. A scheduler that
    hosts the worker takes that worker's bundle and resources: the first
    worker bundle of `reserved`, or a group of its own. Otherwise it asks
    for no CPU and sits in the reserved scheduler bundle (a replica's own),
    or beside the caller."""
    if parallel_config.scheduler_hosts_worker:
        if reserved is not None:
            placement = reserved_worker_placements(reserved, parallel_config, 0)[0]
            return rank_actor_options(parallel_config, device, reserved.pg, placement), None
        name = f"rayvllm-engine-{uuid.uuid4().hex[:8]}"
        pg, placements = create_worker_placement_group(parallel_config, device, name, pending, keep_on_timeout=True)
        return rank_actor_options(parallel_config, device, pg, placements[0]), pg
    if reserved is not None and reserved.scheduler_bundle is not None:
        bundle = reserved.scheduler_bundle
        strategy: Any = PlacementGroupSchedulingStrategy(reserved.pg, placement_group_bundle_index=bundle)
    else:
        strategy = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return {"scheduling_strategy": strategy, "runtime_env": rank_runtime_env()}, None


def rank_actor_options(
    parallel_config: ParallelConfig, device: str, pg: PlacementGroup, placement: RankPlacement
) -> dict[str, Any]:
    """``Actor.options(**...)`` that run one rank inside its bundle.

    The actor asks for exactly its bundle's resources (a bigger ask could
    never be scheduled there; a smaller one would leave the reservation idle
    yet unusable by others) and child tasks stay in the group."""
    bundle = worker_bundles(parallel_config, device)[0]  # every rank's bundle is the same
    return {
        "num_cpus": bundle.get("CPU", 0.0),
        "num_gpus": bundle.get("GPU", 0.0),
        "runtime_env": rank_runtime_env(),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=placement.bundle_index,
            placement_group_capture_child_tasks=True,
        ),
    }


def assign_ranks(
    bundle_nodes: list[str],
    node_ips: dict[str, str],
    driver_node_id: str,
    tp_size: int,
    pp_size: int,
) -> list[RankPlacement]:
    """Pure rank assignment: ``bundle_nodes[i]`` is the node of bundle ``i``.

    Bundles are grouped by node (driver's node first, then by ip and id) and
    ranks dealt out in that order. TP groups are consecutive runs of
    ``tp_size`` ranks, so they all stay on one node exactly when every node
    holds a multiple of ``tp_size`` bundles; no other order can do better."""
    world_size = tp_size * pp_size
    if len(bundle_nodes) != world_size:
        raise PlacementError(f"placement group has {len(bundle_nodes)} bundles, expected {world_size}")
    by_node: dict[str, list[int]] = defaultdict(list)
    for index, node_id in enumerate(bundle_nodes):
        by_node[node_id].append(index)
    order = sorted(by_node, key=lambda n: (n != driver_node_id, node_ips.get(n, ""), n))
    uneven = [n for n in order if len(by_node[n]) % tp_size]
    if uneven:
        layout = ", ".join(f"node {n} ({node_ips.get(n, '?')}): {len(by_node[n])}" for n in order)
        raise PlacementError(
            f"tensor_parallel_size={tp_size} needs each TP group on one node, but the bundles landed "
            f"as {layout} bundle(s), which is not a multiple of {tp_size} on every node; use "
            f"placement_group_strategy='STRICT_PACK', or a tensor_parallel_size that divides the "
            f"bundles each node can hold (more pipeline_parallel_size instead)"
        )
    placements: list[RankPlacement] = []
    for node_id in order:
        for index in by_node[node_id]:
            placements.append(RankPlacement(len(placements), index, node_id, node_ips.get(node_id, "")))
    return placements


def _bundle_nodes(pg: PlacementGroup, num_bundles: int) -> list[str]:
    """Node id of each bundle, read from the GCS once the group is ready.

    The table can lag the ready signal by a moment, so poll briefly."""
    deadline = time.monotonic() + 10.0
    while True:
        mapping = placement_group_table(pg).get("bundles_to_node_id", {})
        if len(mapping) == num_bundles or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    missing = [i for i in range(num_bundles) if i not in mapping]
    if missing:
        raise PlacementError(f"placement group is ready but bundles {missing} report no node")
    return [mapping[i] for i in range(num_bundles)]


def _node_ips() -> dict[str, str]:
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}


def _describe_request(bundles: list[Bundle], strategy: str) -> str:
    shape = _format_resources(bundles[0]) if bundles else "{}"
    total = _format_resources(_sum_resources(bundles))
    where = "all on one node" if strategy == "STRICT_PACK" else "in total"
    return f"requested {len(bundles)} x {shape} with {strategy} ({total} {where})"


def _describe_cluster(bundles: list[Bundle], strategy: str) -> str:
    """What the cluster holds of the resources the bundles ask for, and the
    shortfall that most likely kept the group from being placed."""
    keys = sorted(_sum_resources(bundles))
    available = ray.available_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = "; ".join(
        f"node {n['NodeID']} ({n['NodeManagerAddress']}): "
        + _format_resources({k: n.get("Resources", {}).get(k, 0.0) for k in keys})
        for n in nodes
    )
    free = _format_resources({k: available.get(k, 0.0) for k in keys})
    return f"cluster has {free} available, per-node totals: {per_node or 'no alive nodes'}{_shortfall(bundles, strategy, available, nodes)}"


def _shortfall(bundles: list[Bundle], strategy: str, available: dict[str, float], nodes: list[dict[str, Any]]) -> str:
    need = _sum_resources(bundles)
    missing = {k: v - available.get(k, 0.0) for k, v in need.items() if v > available.get(k, 0.0)}
    if missing:
        return f"; missing {_format_resources(missing)} cluster-wide"
    if strategy == "STRICT_PACK":
        best = {k: max((n.get("Resources", {}).get(k, 0.0) for n in nodes), default=0.0) for k in need}
        short = {k: need[k] - best[k] for k in need if best[k] < need[k]}
        if short:
            return f"; STRICT_PACK needs {_format_resources(need)} on one node but the largest node has {_format_resources(best)}"
    if strategy == "STRICT_SPREAD" and len(nodes) < len(bundles):
        return f"; STRICT_SPREAD needs {len(bundles)} nodes but the cluster has {len(nodes)}"
    return "; resources may be held by other placement groups or actors"


def _sum_resources(bundles: list[Bundle]) -> Bundle:
    total: Bundle = defaultdict(float)
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] += value
    return dict(total)


def _format_resources(resources: Bundle) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
