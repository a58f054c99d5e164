"""A node is lost mid-generation (issue 16): on a cluster of a head and two
worker nodes (`ray.cluster_utils.Cluster`), the node that runs the engine is
removed while streams are in flight. The engine starts again on the other
node and every stream finishes exactly as an undisturbed run; nothing of
the lost engine is left behind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
import ray_state  # noqa: E402

from rayvllm import LLM, SamplingParams  # noqa: E402
from rayvllm.actors.factory import async_llm_from_engine_args  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.messages.errors import EngineDeadError  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=32 << 20)
PROMPTS = [[5, 6, 7, 8, 9] * k for k in (1, 3)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_private: None) -> Iterator[tuple[Cluster, list[object]]]:
    # The head runs no work (as a cloud head node often does); each worker
    # node has room for the engine (world size 1: one actor, one CPU). No
    # dashboard: actors and groups are read from the GCS (ray_state.py).
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def _schedulers() -> list[ray_state.ActorState]:
    return ray_state.actors("SchedulerActor", "ALIVE")


def _groups() -> list[str]:
    return list(ray_state.live_placement_groups())


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> list[list[int]]:
    """PROMPTS' tokens from the in-process engine, undisturbed."""
    llm = LLM(str(tiny_model_dir), **ENGINE)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_lost_node_engine_restarts_on_another(
    cluster: tuple[Cluster, list[object]], tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    c, nodes = cluster

    async def main() -> tuple[list[list[int]], str, str, int]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            (first,) = _schedulers()
            victim = next(n for n in nodes if n.node_id == first.node_id)
            tokens: list[list[int]] = [[] for _ in PROMPTS]

            async def consume(i: int) -> None:
                async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS, f"r{i}"):
                    tokens[i] += out.outputs[0].token_ids
                    if i == 0 and len(tokens[0]) >= 5 and victim in nodes:
                        nodes.remove(victim)
                        c.remove_node(victim)  # the node is gone, its processes with it

            await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
            (second,) = _schedulers()
            return tokens, first.node_id, second.node_id, engine.restarts.total
        finally:
            engine.shutdown()

    tokens, before, after, restarts = asyncio.run(main())
    assert restarts == 1 and before != after
    assert tokens == expected
    for _ in range(300):
        if not _schedulers():
            break
        ray.get(ray.remote(num_cpus=0)(lambda: None).remote())
    assert _schedulers() == []
    assert _groups() == []


def test_without_room_requests_wait_until_a_node_returns(
    cluster: tuple[Cluster, list[object]], tiny_model_dir: Path, expected: list[list[int]]
) -> None:
    """The engine's only node goes and no other has room: the requests wait
    (health says the engine is restarting) and finish exactly once a node
    joins. One worker node to start with (the test above leaves one;
    alone, this one removes the other)."""
    c, nodes = cluster
    while len(nodes) > 1:
        c.remove_node(nodes.pop())
    async def main() -> tuple[list[list[int]], str, list[bool]]:
        engine = async_llm_from_engine_args(EngineArgs(
            model=str(tiny_model_dir), distributed_executor_backend="ray", placement_group_timeout_s=2, **ENGINE
        ))
        try:
            tokens: list[list[int]] = [[] for _ in PROMPTS]
            health: list[str] = []
            kept_its_group: list[bool] = []

            def engine_groups() -> set[str]:
                return {g for g, info in ray.util.placement_group_table().items()
                        if info["name"].startswith("rayvllm-engine-")}

            async def waits(n: int) -> None:
                while engine.restarts.restarting_since is None or engine.restarts.placement_waits < n:
                    await asyncio.sleep(0.05)  # polling another thread's state change

            async def restore() -> None:
                # Wait for the engine to notice and find no room twice: the
                # second try waits on the group the first made, none new.
                await waits(1)
                groups = engine_groups()
                await waits(2)
                kept_its_group.append(engine_groups() == groups)
                try:
                    await engine.check_health()
                except EngineDeadError as e:
                    health.append(str(e))
                # Serve's replica hook asks so: the replica is not replaced.
                await engine.check_health(allow_restarting=True)
                nodes.append(c.add_node(num_cpus=1))

            async def consume(i: int) -> None:
                async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS, f"r{i}"):
                    tokens[i] += out.outputs[0].token_ids
                    if i == 0 and len(tokens[0]) >= 5 and not health and nodes:
                        c.remove_node(nodes.pop())
                        asyncio.ensure_future(restore())

            await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
            return tokens, health[0], kept_its_group
        finally:
            engine.shutdown()

    tokens, health, kept_its_group = asyncio.run(main())
    assert kept_its_group == [True]
    assert "restarting" in health
    assert tokens == expected
