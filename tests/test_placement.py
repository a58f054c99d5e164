"""Placement of one worker group over a real multi-node Ray cluster.

One `ray.cluster_utils.Cluster` for the whole module (startup is slow on a
small machine): a head with no CPUs, so nothing lands on the driver's node,
and two worker nodes with 2 CPUs each.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import PlacementGroup, placement_group_table  # noqa: E402

from rayvllm import LLM, SamplingParams  # noqa: E402
from rayvllm.actors.placement import (  # noqa: E402
    RankPlacement,
    assign_ranks,
    create_worker_placement_group,
    rank_actor_options,
    remove_worker_placement_group,
    worker_bundles,
)
from rayvllm.actors.ray_executor import RayExecutor  # noqa: E402
from rayvllm.config import EngineConfig, ParallelConfig  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.messages.errors import DistributedInitError, PlacementError  # noqa: E402


@ray.remote
class _NodeReporter:
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def worker_nodes(ray_private: None) -> Iterator[list[str]]:
    """Node ids of the two 2-CPU worker nodes."""
    # No dashboard: nothing here asks the state API.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
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


def test_the_scheduler_hosts_the_model_only_for_a_single_worker() -> None:
    assert ParallelConfig().scheduler_hosts_worker
    assert not ParallelConfig(tensor_parallel_size=2).scheduler_hosts_worker
    assert not ParallelConfig(pipeline_parallel_size=2).scheduler_hosts_worker
    assert not ParallelConfig(data_parallel_size=2).scheduler_hosts_worker


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


# ---- a real worker group (RayExecutor, then the full engine) over the cluster ----------

# Small enough to start fast on a 2-core machine; the group takes all 4 CPUs of
# the two worker nodes, so only one group can exist at a time.
_ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=16 << 20)


def _tp2_pp2_config(model_dir: Path, **overrides: float) -> EngineConfig:
    return EngineArgs(
        model=str(model_dir),
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        placement_group_timeout_s=60,
        **_ENGINE,
        **overrides,
    ).create_engine_config()


def _group_name(pg: PlacementGroup) -> str:
    return placement_group_table(pg)["name"]


def _live_engine_groups() -> dict[str, dict]:
    """Engine placement groups (named rayvllm-dp*) not yet removed."""
    return {
        info["name"]: info
        for info in placement_group_table().values()
        if info["name"].startswith("rayvllm-dp") and info["state"] != "REMOVED"
    }


def test_tp2_pp2_engine_over_cluster_matches_single_process(
    worker_nodes: list[str], tiny_model_dir: Path
) -> None:
    prompts = [[1, 17, 230, 4000, 9, 52], [1, 3000, 12, 7, 7, 7, 801, 66, 5, 1234, 99]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    single = LLM(str(tiny_model_dir), **_ENGINE)  # world size 1: in-process, no Ray
    try:
        expected = greedy(single)
    finally:
        single.shutdown()

    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, pipeline_parallel_size=2, **_ENGINE)
    try:
        groups = _live_engine_groups()
        assert len(groups) == 1
        (info,) = groups.values()
        bundle_nodes = list(info["bundles_to_node_id"].values())
        assert sorted(bundle_nodes) == sorted(worker_nodes * 2)  # two ranks on each worker node
        got = greedy(llm)
    finally:
        llm.shutdown()
    assert got == expected
    assert all(len(tokens) == 8 for tokens in got)
    deadline = time.monotonic() + 5.0
    while _live_engine_groups() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_engine_groups() == {}


def test_preflight_names_the_rank_that_did_not_answer(worker_nodes: list[str], tiny_model_dir: Path) -> None:
    """TP=2 x PP=2 workers: each TP group on one node, the stages across
    nodes, each rank where the placement said; then, with rank 1 killed
    before the group forms, the preflight blames rank 1 alone. (The ranks
    forming the group and loading the model there:
    test_tp2_pp2_engine_over_cluster_matches_single_process.)"""
    ex = RayExecutor(_tp2_pp2_config(tiny_model_dir, distributed_timeout_s=5))
    name = None
    try:
        ex.start_workers()
        name = _group_name(ex.pg)
        # Let every rank come up first, so the 5 s budget is spent on forming
        # the group, not on importing torch on a busy machine.
        reported = ray.get([w.node.remote() for w in ex.workers], timeout=120)
        nodes = [node_id for node_id, _ in reported]
        # Ranks 0,1 (stage 0) and 2,3 (stage 1) are TP groups; two 2-CPU nodes
        # for four 1-CPU ranks force the stages onto different nodes.
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3]
        assert nodes[0] != nodes[2]
        assert set(nodes) == set(worker_nodes)
        # Where the actors really run is where the placement said they would.
        assert reported == [(p.node_id, p.node_ip) for p in ex.placements]
        ray.kill(ex.workers[1])
        # Dead before the group forms. The kill is asynchronous: a call made
        # right after it may still be answered (CI met that once), so ask
        # until the actor is gone. (Dying inside the rendezvous instead is
        # blamed the same way: the next test.)
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get(ex.workers[1].node.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "rank 1 outlived its kill by a minute"
        start = time.monotonic()
        with pytest.raises(DistributedInitError) as info:
            ex.init_distributed()
        elapsed = time.monotonic() - start
    finally:
        ex.shutdown()
    assert name is not None
    _assert_gone(name)
    message = str(info.value)
    assert "did not answer: " in message, message
    silent = message.split("did not answer: ", 1)[1].split(". raised: ", 1)[0].split(". still waiting", 1)[0]
    # Only rank 1 is blamed as silent, with its node; the live ranks are not.
    assert re.findall(r"\brank (\d+) \(", silent) == ["1"], message
    p1 = ex.placements[1]
    assert f"rank 1 (node {p1.node_ip} id {p1.node_id[:12]}" in silent, message
    # Bounded by distributed_timeout_s (plus the executor's fixed slack), never a hang.
    assert elapsed < 5 + 15 + 10, elapsed


def test_a_rank_dying_inside_a_call_ends_the_wait_and_only_it_is_blamed(
    worker_nodes: list[str], tiny_model_dir: Path
) -> None:
    """A rank whose actor dies inside a call that the others block on (as a
    rendezvous blocks without its last member): the executor stops waiting
    at once, blames the dead rank, and names the blocked ones as waiting.
    Without that, the wait ran to its bound (here 600 s: the test's own
    timeout would end it first) and blamed every rank."""

    @ray.remote(num_cpus=0)
    class Rank:
        def block(self) -> None:
            threading.Event().wait()  # a peer that never arrives

        def die(self) -> None:
            os._exit(1)

    ranks = [Rank.remote() for _ in range(3)]
    try:
        executor = RayExecutor(_tp2_pp2_config(tiny_model_dir))  # not started: its ranks are unplaced
        refs = [ranks[0].block.remote(), ranks[1].die.remote(), ranks[2].block.remote()]
        with pytest.raises(DistributedInitError) as info:
            executor._on_all("process group init", refs, timeout=600)
    finally:
        for rank in ranks:
            ray.kill(rank)
    message = str(info.value)
    assert message.startswith("worker group of DP rank 0 failed at process group init. did not answer: rank 1 "
                              "(unplaced; its actor died"), message
    assert message.endswith(". still waiting, likely on the dead rank (not blamed): rank 0 (unplaced); "
                            "rank 2 (unplaced)"), message
