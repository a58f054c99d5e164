"""Placement of one worker group over a real multi-node Ray cluster.

One `ray.cluster_utils.Cluster` for the whole module (startup is slow on a
small machine): a head with no CPUs, so nothing lands on the driver's node,
and two worker nodes with 2 CPUs each.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import PlacementGroup, placement_group_table  # noqa: E402

from rayvllm.config import ParallelConfig  # noqa: E402
from rayvllm.errors import PlacementError  # noqa: E402
from rayvllm.executor.placement import (  # noqa: E402
    RankPlacement,
    assign_ranks,
    create_worker_placement_group,
    rank_actor_options,
    remove_worker_placement_group,
    worker_bundles,
)


@ray.remote
class _NodeReporter:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def worker_nodes() -> Iterator[list[str]]:
    """Node ids of the two 2-CPU worker nodes."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield [node.node_id for node in nodes]
    finally:
        ray.shutdown()
        cluster.shutdown()


def _live_groups(name: str) -> list[str]:
    """States of groups called `name` that still hold or wait for resources."""
    return [
        info["state"]
        for info in placement_group_table().values()
        if info["name"] == name and info["state"] != "REMOVED"
    ]


def _assert_gone(name: str) -> None:
    # Removal is acknowledged by the GCS asynchronously; give it a moment.
    deadline = time.monotonic() + 5.0
    while _live_groups(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_groups(name) == []


def _actual_nodes(config: ParallelConfig, pg: PlacementGroup, placements: list[RankPlacement]) -> list[str]:
    """Where actors scheduled into each rank's bundle really run."""
    actors = [
        _NodeReporter.options(**rank_actor_options(config, "cpu", pg, p)).remote()  # type: ignore[attr-defined]
        for p in placements
    ]
    try:
        return ray.get([a.node_id.remote() for a in actors], timeout=60)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_worker_bundles_follow_device() -> None:
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3, num_cpus_per_worker=0.5)
    assert worker_bundles(config, "cuda") == [{"GPU": 1.0}] * 6
    assert worker_bundles(config, "cpu") == [{"CPU": 0.5}] * 6


def test_assign_ranks_puts_driver_node_first_and_rejects_split_tp() -> None:
    ips = {"a": "10.0.0.2", "b": "10.0.0.1", "drv": "10.0.0.9"}
    placements = assign_ranks(["a", "drv", "b", "drv", "a", "b"], ips, "drv", tp_size=2, pp_size=3)
    assert [(p.rank, p.bundle_index, p.node_id) for p in placements] == [
        (0, 1, "drv"), (1, 3, "drv"), (2, 2, "b"), (3, 5, "b"), (4, 0, "a"), (5, 4, "a"),
    ]
    with pytest.raises(PlacementError, match=r"node a \(10.0.0.2\): 3.*STRICT_PACK"):
        assign_ranks(["a", "a", "a", "b"], ips, "drv", tp_size=2, pp_size=2)


def test_tp2_pp2_pack_keeps_tp_on_a_node_and_pp_across(worker_nodes: list[str]) -> None:
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, placement_group_timeout_s=30)
    pg, placements = create_worker_placement_group(config, "cpu", "tp2pp2")
    try:
        assert [p.rank for p in placements] == [0, 1, 2, 3]
        assert sorted(p.bundle_index for p in placements) == [0, 1, 2, 3]
        nodes = [p.node_id for p in placements]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]
        assert {nodes[0], nodes[2]} == set(worker_nodes)
        # Ties between nodes of one ip break by node id.
        assert nodes[0] == min(worker_nodes)
        assert _actual_nodes(config, pg, placements) == nodes
    finally:
        remove_worker_placement_group(pg)
    _assert_gone("tp2pp2")


def test_tp2_strict_pack_lands_on_one_node(worker_nodes: list[str]) -> None:
    config = ParallelConfig(
        tensor_parallel_size=2, placement_group_strategy="STRICT_PACK", placement_group_timeout_s=30
    )
    pg, placements = create_worker_placement_group(config, "cpu", "tp2")
    try:
        assert len({p.node_id for p in placements}) == 1
        assert placements[0].node_id in worker_nodes
        assert _actual_nodes(config, pg, placements) == [p.node_id for p in placements]
    finally:
        remove_worker_placement_group(pg)
    _assert_gone("tp2")


def test_pack_that_splits_a_tp_group_is_rejected(worker_nodes: list[str]) -> None:
    # PACK places 4 one-CPU bundles as 2 + 2; TP=4 cannot live on one node.
    config = ParallelConfig(tensor_parallel_size=4, placement_group_timeout_s=30)
    with pytest.raises(PlacementError, match=r"tensor_parallel_size=4.*: 2.*: 2 bundle.*STRICT_PACK"):
        create_worker_placement_group(config, "cpu", "tp4")
    _assert_gone("tp4")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            ParallelConfig(tensor_parallel_size=4, placement_group_strategy="STRICT_PACK"),
            r"4 x \{CPU: 1\} with STRICT_PACK.*STRICT_PACK needs \{CPU: 4\} on one node but the largest "
            r"node has \{CPU: 2\}",
        ),
        (ParallelConfig(num_cpus_per_worker=100), r"1 x \{CPU: 100\} with PACK.*missing \{CPU: 96\}"),
    ],
    ids=["strict_pack_4", "cpu_100"],
)
def test_unplaceable_group_times_out_naming_resources(
    worker_nodes: list[str], config: ParallelConfig, expected: str
) -> None:
    config.placement_group_timeout_s = 3.0
    start = time.monotonic()
    with pytest.raises(PlacementError, match=expected) as info:
        create_worker_placement_group(config, "cpu", "unplaceable")
    assert time.monotonic() - start < 10.0
    assert "not placed within 3s" in str(info.value)
    for node_id in worker_nodes:
        assert f"node {node_id} (" in str(info.value)
    _assert_gone("unplaceable")
