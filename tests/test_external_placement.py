"""An engine in a caller's placement group (issue 29; docs/RL.md): an RL
trainer reserves bundles for itself and the engine, and the engine's
workers take the bundles it names, rank by rank, and leave the group as it
was. Real Ray actors on the shared cluster: where each rank runs is read
from the worker itself; bad bundle lists are errors before anything starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import ray_state
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rayvllm import LLM, SamplingParams
from rayvllm.messages.errors import InvalidParameterError

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=4 << 20)


def greedy(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture()
def trainer_group(ray_local: None) -> Iterator[PlacementGroup]:
    """Four bundles as a trainer would reserve them: 0 and 2 for itself
    (a half-CPU one among them), 1 and 3 for the engine's ranks."""
    pg = placement_group([{"CPU": 1}, {"CPU": 1}, {"CPU": 0.5}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=60)
    yield pg
    remove_placement_group(pg)


def test_tp2_ranks_take_the_named_bundles_and_leave_the_group(
    trainer_group: PlacementGroup, tiny_model_dir: Path
) -> None:
    reference = LLM(model=str(tiny_model_dir), **ENGINE)
    expected = greedy(reference)
    reference.shutdown()
    llm = LLM(
        model=str(tiny_model_dir), tensor_parallel_size=2, placement_group=trainer_group,
        placement_group_bundle_indices=[3, 1], **ENGINE,
    )
    def actor_id(worker: object) -> str:
        """The rank's actor. Defined here: Ray workers cannot import this
        module, a nested function travels by value."""
        return ray.get_runtime_context().get_actor_id()

    try:
        group_id = trainer_group.id.hex()
        bundles = []
        for actor in llm.collective_rpc(actor_id):
            state = ray_state.actor(actor)
            assert state.placement_group_id == group_id
            # Ray names a bundle's resources `CPU_group_<bundle>_<group id>`.
            bundles += [
                int(k.split("_")[2]) for k in state.required_resources if k.startswith("CPU_group_") and k.count("_") == 3
            ]
        assert bundles == [3, 1]  # rank 0 in bundle 3, rank 1 in bundle 1
        assert greedy(llm) == expected
    finally:
        llm.shutdown()
    # The caller's group stays, and its bundles are free again: an actor can take one.
    assert placement_group_table(trainer_group)["state"] == "CREATED"
    probe = ray.remote(num_cpus=1)(lambda: "ran").options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            trainer_group, placement_group_bundle_index=3
        )
    )
    assert ray.get(probe.remote(), timeout=60) == "ran"


@pytest.mark.parametrize(
    "indices, message",
    [
        ([1], "one bundle per rank: 2"),
        ([1, 1], "names a bundle twice"),
        ([1, 7], "bundle 7 is not in the group's 4 bundles"),
        ([1, 2], "bundle 2 holds"),
    ],
    ids=["count", "twice", "missing", "too-small"],
)
def test_bad_bundle_lists_are_refused_before_anything_starts(
    trainer_group: PlacementGroup, tiny_model_dir: Path, indices: list[int], message: str
) -> None:
    actors_before = len(ray_state.actors(state="ALIVE"))
    with pytest.raises(InvalidParameterError, match=message) as info:
        LLM(
            model=str(tiny_model_dir), tensor_parallel_size=2, placement_group=trainer_group,
            placement_group_bundle_indices=indices, **ENGINE,
        )
    assert info.value.param == "placement_group_bundle_indices"
    assert len(ray_state.actors(state="ALIVE")) == actors_before


def test_a_placement_group_needs_the_ray_backend(tiny_model_dir: Path, trainer_group: PlacementGroup) -> None:
    with pytest.raises(InvalidParameterError, match="needs the Ray backend"):
        LLM(model=str(tiny_model_dir), placement_group=trainer_group, **ENGINE)
    with pytest.raises(InvalidParameterError, match="needs placement_group"):
        LLM(model=str(tiny_model_dir), tensor_parallel_size=2, placement_group_bundle_indices=[0, 1], **ENGINE)
