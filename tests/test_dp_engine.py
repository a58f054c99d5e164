"""Data-parallel routing through the real engine core: two DP ranks, each
with its own scheduler, block pool and model runner (in-process executors,
so the routing logic is tested without Ray; the Ray path runs the same
`EngineCore` inside the SchedulerActor)."""

from __future__ import annotations

import random
import select
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from rayvllm.config import EngineConfig
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.engine_core import EngineCore
from rayvllm.executor.base import Executor, PendingOutput
from rayvllm.executor.uniproc import UniProcExecutor
from rayvllm.messages.block_hash import hash_request_tokens
from rayvllm.messages.engine_types import ModelRunnerOutput
from rayvllm.messages.errors import EngineDeadError
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.scheduler_output import SchedulerOutput

BLOCK = 16


@pytest.fixture()
def core(tiny_model_dir: Path) -> EngineCore:
    # 20 blocks per rank (19 usable): two 150-token requests on one rank
    # recycle every free block, evicting what was cached before.
    config = EngineArgs(
        model=str(tiny_model_dir), data_parallel_size=2, max_model_len=256, num_gpu_blocks_override=20,
        max_num_batched_tokens=512,
    ).create_engine_config()
    return EngineCore(config, lambda rank: UniProcExecutor(config))


_rng = random.Random(3)
PREFIX = [_rng.randrange(5, 4000) for _ in range(4 * BLOCK)]


def _request(req_id: str, tokens: list[int], max_tokens: int = 2) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(req_id, tokens, params, eos_token_id=None)


def _fresh(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _run_to_completion(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def test_shared_prefix_goes_to_the_rank_that_holds_it(core: EngineCore) -> None:
    core.add_request(_request("a", PREFIX + [7, 8, 9]))
    assert core.request_rank["a"] == 0  # idle ranks tie; the lower rank wins
    _run_to_completion(core)
    assert core.prefix_index is not None
    assert core.prefix_index.longest_prefix_hits(hash_request_tokens(BLOCK, PREFIX)) == [4, 0]

    # Rank 0 now has queued work, yet the request sharing its prefix goes there.
    core.add_request(_request("busy", _fresh(100, seed=1)))
    assert core.request_rank["busy"] == 0
    core.add_request(_request("b", PREFIX + [10, 11]))
    assert core.request_rank["b"] == 0
    # A request with no hit anywhere goes to the less loaded rank.
    core.add_request(_request("c", _fresh(40, seed=2)))
    assert core.request_rank["c"] == 1

    hits: dict[str, int] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            hits.setdefault(out.request_id, out.num_cached_tokens)
    assert hits["b"] == 4 * BLOCK


def test_index_forgets_blocks_the_rank_evicted(core: EngineCore) -> None:
    prefix_hashes = hash_request_tokens(BLOCK, PREFIX)
    core.add_request(_request("a", PREFIX + [7]))
    _run_to_completion(core)
    assert core.prefix_index.longest_prefix_hits(prefix_hashes) == [4, 0]

    # Two long requests, one after the other, land on idle rank 0 and take
    # every block of its pool, evicting the cached prefix.
    for i in range(2):
        core.add_request(_request(f"long{i}", _fresh(150, seed=10 + i)))
        assert core.request_rank[f"long{i}"] == 0
        _run_to_completion(core)
    assert core.prefix_index.longest_prefix_hits(prefix_hashes) == [0, 0]
    assert not any(core.schedulers[0].kv_cache_manager.block_pool.get_cached_block(h) for h in prefix_hashes)

    # With the prefix gone, load decides: rank 0 is busy, so rank 1.
    core.add_request(_request("busy", _fresh(100, seed=20)))
    core.add_request(_request("b", PREFIX + [8]))
    assert core.request_rank["b"] == 1


def test_n_children_share_one_rank(core: EngineCore) -> None:
    core.add_request(_request("busy", _fresh(100, seed=30)))
    children = [
        EngineCoreRequest(f"{i}_p", PREFIX, SamplingParams(temperature=0.0, max_tokens=2), None, parent_request_id="p")
        for i in range(3)
    ]
    core.add_requests(children)
    assert {core.request_rank[c.request_id] for c in children} == {1}
    _run_to_completion(core)
    assert core.request_rank == {}


class _GatedStep:
    """A step on a fake worker group that finishes only once its gate (one
    end of a socket pair) has been written: `done()` and `result()` read its
    readiness the way the Ray executor reads its channels'."""

    def __init__(self, so: SchedulerOutput, gate: socket.socket) -> None:
        self.so = so
        self.gate = gate

    def done(self) -> bool:
        return bool(select.select([self.gate], [], [], 0)[0])

    def wait_handles(self) -> list[object]:
        return [self.gate]

    def result(self) -> ModelRunnerOutput:
        select.select([self.gate], [], [])
        ids = list(self.so.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [7] * len(ids), None, {})


class _GatedExecutor(Executor):
    """Every scheduled request samples token 7 (prompts fit one step); steps
    finish once `open()` is called (at once when built open)."""

    def __init__(self, config: EngineConfig, is_open: bool) -> None:
        super().__init__(config)
        self.gate, self._opener = socket.socketpair()
        self.submitted = 0
        if is_open:
            self.open()

    def open(self) -> None:
        self._opener.send(b"x")  # never read: the gate stays open

    def initialize(self) -> int:
        return 128  # blocks of 4 tokens: more than one max_model_len=256 sequence needs

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> _GatedStep:
        self.submitted += 1
        return _GatedStep(scheduler_output, self.gate)


def test_a_rank_keeps_stepping_while_another_ranks_step_is_held(tiny_model_dir: Path) -> None:
    """DP ranks never wait on each other: with one rank's step held (a long
    prefill, say), the other rank's request runs to its end; the held rank
    then catches up, and nothing is lost or duplicated."""
    config = EngineArgs(
        model=str(tiny_model_dir), data_parallel_size=2, max_model_len=256, block_size=4,
        max_num_batched_tokens=64,
    ).create_engine_config()
    held, free = _GatedExecutor(config, is_open=False), _GatedExecutor(config, is_open=True)
    core = EngineCore(config, [held, free].__getitem__)
    core.add_request(_request("a", [11, 12, 13], max_tokens=6))
    core.add_request(_request("b", [21, 22, 23], max_tokens=6))
    assert core.request_rank == {"a": 0, "b": 1}  # routed by load: one request per rank
    tokens: dict[str, int] = {"a": 0, "b": 0}
    finished: set[str] = set()

    def step_until(done: Callable[[], bool]) -> None:
        while not done():
            for out in core.step():
                tokens[out.request_id] += len(out.new_token_ids)
                if out.finished:
                    finished.add(out.request_id)

    # Each call returns once rank 1 has a finished step; were the ranks in
    # lockstep, the first call would block on rank 0 for good.
    worker = threading.Thread(target=step_until, args=(lambda: "b" in finished,), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "rank 1 waited on rank 0's held step"
    assert tokens == {"a": 0, "b": 6} and finished == {"b"}
    assert held.submitted >= 1  # rank 0's first step is on its workers, held
    held.open()
    step_until(lambda: "a" in finished)
    assert tokens == {"a": 6, "b": 6} and not core.has_unfinished_requests()


class _DyingExecutor(UniProcExecutor):
    """The real model in-process, whose group "dies" on its `dies_at`-th
    step: that step reports `EngineDeadError`, as a Ray group whose worker
    was killed does."""

    def __init__(self, config: EngineConfig, dies_at: int) -> None:
        super().__init__(config)
        self.dies_at = dies_at
        self.steps = 0
        self.shut_down = False

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        self.steps += 1
        if self.steps >= self.dies_at:
            return _Dead()
        return super().execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        self.shut_down = True


class _Dead:
    def done(self) -> bool:
        return True

    def wait_handles(self) -> list[object]:
        return []

    def result(self) -> ModelRunnerOutput:
        raise EngineDeadError("worker rank 0 of DP rank 1 is gone")


class _HeldBuild(UniProcExecutor):
    """A rebuilt group whose start waits for `release` (a slow placement)."""

    release = threading.Event()

    def initialize(self) -> int:
        assert self.release.wait(timeout=300)
        return super().initialize()


def test_a_dead_rank_is_rebuilt_while_the_other_serves(tiny_model_dir: Path) -> None:
    """DP rank 1's worker group dies mid-decode: its requests move to a
    fresh scheduler and its group is rebuilt on a thread; rank 0's request
    runs to its end while the rebuild is held; then rank 1 resumes by
    recompute and every request's tokens equal an undisturbed run's (the
    engine is never restarted)."""
    config, prompts, expected = _undisturbed_dp2(tiny_model_dir)
    dying = _DyingExecutor(config, dies_at=4)
    builds: list[Executor] = []

    def build(rank: int) -> Executor:
        """The first group of each rank, then the rebuilt ones."""
        if rank == 0 and not builds:
            builds.append(UniProcExecutor(config))
            return builds[0]
        if rank == 1 and len(builds) == 1:
            builds.append(dying)
            return dying
        builds.append(_HeldBuild(config))
        return builds[-1]

    core = EngineCore(config, build)
    _HeldBuild.release.clear()
    for req_id, prompt in prompts.items():
        core.add_request(_request(req_id, prompt, max_tokens=12))
    on_rank_1 = {r for r, rank in core.request_rank.items() if rank == 1}
    assert on_rank_1 and on_rank_1 != set(prompts)
    tokens, finished = _tokens_until(core, lambda done: set(prompts) - on_rank_1 <= done)
    # Rank 0 is done while rank 1 waits for its new group.
    assert dying.shut_down and 1 in core.recoveries and not on_rank_1 & finished
    assert not any(core.inflight[1]) and core.executors[1] is dying
    _HeldBuild.release.set()
    more, _ = _tokens_until(core, lambda done: len(done) == 3, tokens, finished)
    assert more == expected
    assert core.executors[1] is builds[2] and not core.recoveries and len(builds) == 3
    assert core.make_stats().num_rank_rebuilds == 1
    core.shutdown()


class _DiesInStart(UniProcExecutor):
    """A rebuilt group whose process is killed as it starts."""

    def initialize(self) -> int:
        raise EngineDeadError("worker rank 0 of DP rank 1 died as it started")


def test_a_rebuild_that_dies_as_it_starts_is_tried_again(tiny_model_dir: Path) -> None:
    """DP rank 1's group dies mid-decode and its first replacement dies as
    it starts: one more failure of the same kind, under the engine's
    restart rule. The next start serves, and every request's tokens equal
    an undisturbed run's."""
    config, prompts, expected = _undisturbed_dp2(tiny_model_dir)
    groups = iter([UniProcExecutor(config), _DyingExecutor(config, dies_at=4), _DiesInStart(config)])
    core = EngineCore(config, lambda rank: next(groups, None) or UniProcExecutor(config))
    for req_id, prompt in prompts.items():
        core.add_request(_request(req_id, prompt, max_tokens=12))
    tokens, _ = _tokens_until(core, lambda done: len(done) == 3)
    assert tokens == expected
    assert (core.rebuild_limits.failed_starts, core.num_rank_rebuilds) == (1, 1)
    core.shutdown()


def _undisturbed_dp2(tiny_model_dir: Path) -> tuple[EngineConfig, dict[str, list[int]], dict[str, list[int]]]:
    """The DP=2 config of the rebuild tests, their prompts, and the tokens
    each gets with no failure."""
    config = EngineArgs(
        model=str(tiny_model_dir), data_parallel_size=2, max_model_len=256, max_num_batched_tokens=512,
    ).create_engine_config()
    prompts = {"a": _fresh(20, 1), "b": _fresh(33, 2), "c": _fresh(9, 3)}
    core = EngineCore(config, lambda rank: UniProcExecutor(config))
    for req_id, prompt in prompts.items():
        core.add_request(_request(req_id, prompt, max_tokens=12))
    expected = _tokens_until(core, lambda done: len(done) == 3)[0]
    core.shutdown()
    return config, prompts, expected


def _tokens_until(
    core: EngineCore, done: Callable[[set[str]], bool],
    tokens: dict[str, list[int]] | None = None, finished: set[str] | None = None,
) -> tuple[dict[str, list[int]], set[str]]:
    tokens = tokens if tokens is not None else {}
    finished = finished if finished is not None else set()
    while not done(finished):
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
    return tokens, finished
