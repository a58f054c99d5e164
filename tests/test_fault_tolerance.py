"""A dead engine costs seconds, never the requests (issue 16): when the
process that runs the model is killed (SIGKILL, by its process id) in the
middle of generation, `AsyncLLM` starts a new engine and resumes every
unfinished request from its prompt plus the tokens already streamed. The
streams go on with no token repeated or lost: greedy and seeded outputs
equal an undisturbed run's. Nothing of the dead engine is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import ray_state  # noqa: E402

from rayvllm import LLM, SamplingParams  # noqa: E402
from rayvllm.actors.factory import async_llm_from_engine_args  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.engine.async_llm import AsyncLLM  # noqa: E402
from rayvllm.messages.errors import EngineDeadError, RequestFailedError  # noqa: E402

from fault_hooks import DIE_IN_START_FLAG_ENV, HANG_FLAG_ENV, HANG_SEED, POISON_SEED  # noqa: E402

ENGINE = dict(max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=32 << 20)
PROMPTS = [[5, 6, 7, 8, 9] * k for k in (1, 3, 6)]
NUM_NEW = 48
# The faults strike when the first stream has 5 tokens, as this process
# reads them; on a busy machine the engine can be far ahead of that reader.
# The first stream runs long, so that a fault still lands while it runs.
NUM_LONG = 200
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=NUM_LONG, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=NUM_NEW, ignore_eos=True)
PARAMS = [LONG, GREEDY, SEEDED]


@pytest.fixture(scope="module")
def hang_flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hang") / "hung-once"


@pytest.fixture(scope="module")
def die_in_start_flag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("die") / "die-in-next-start"


@pytest.fixture(scope="module")
def ray_local(hang_flag: Path, die_in_start_flag: Path, ray_private: None) -> Iterator[None]:
    # Every Ray worker process gets the faults of fault_hooks.py (each only
    # triggered by a request with its own seed).
    tests_dir = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, HANG_FLAG_ENV: str(hang_flag), DIE_IN_START_FLAG_ENV: str(die_in_start_flag)}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"worker_process_setup_hook": "fault_hooks.install", "env_vars": env})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_model_dir), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _live_groups() -> list[str]:
    return list(ray_state.live_placement_groups())


def _alive(class_name: str) -> list[ray_state.ActorState]:
    return ray_state.actors(class_name, "ALIVE")


async def _stream_all(
    engine: AsyncLLM, fault: Callable[[], None], id_prefix: str = "r"
) -> tuple[list[list[int]], int]:
    """Every prompt of PROMPTS streamed with its PARAMS; `fault` runs once,
    when the first stream has 5 tokens. The tokens, and how many the first
    stream had then."""
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    at: list[int] = []

    async def consume(i: int) -> None:
        async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS[i], f"{id_prefix}{i}"):
            tokens[i] += out.outputs[0].token_ids
            if i == 0 and len(tokens[0]) >= 5 and not at:
                at.append(len(tokens[0]))
                fault()

    await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
    return tokens, at[0]


def test_killed_engine_is_replaced_and_every_stream_finishes_exactly(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    async def main() -> tuple[list[list[int]], int, int]:
        # World size 1: the SchedulerActor runs the model itself.
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            (victim,) = _alive("SchedulerActor")
            tokens, killed_at = await _stream_all(engine, lambda: os.kill(victim.pid, signal.SIGKILL))
            stats = engine.engine_core.make_stats()
            assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
            (successor,) = _alive("SchedulerActor")
            assert successor.actor_id != victim.actor_id
            return tokens, engine.restarts.total, killed_at
        finally:
            engine.shutdown()

    tokens, restarts, killed_at = asyncio.run(main())
    assert restarts == 1 and killed_at < NUM_LONG
    assert tokens == undisturbed
    # Shut down: no engine actor or placement group of either engine remains.
    for _ in range(300):
        if not _alive("SchedulerActor"):
            break
        ray.get(ray.remote(lambda: None).remote())  # one scheduling round trip
    assert _alive("SchedulerActor") == []
    assert _live_groups() == []


def test_a_replacement_killed_while_it_starts_is_one_more_failure(
    ray_local: None, die_in_start_flag: Path, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """The SchedulerActor is killed mid-generation, and then its replacement
    is killed too, inside its `start` (fault_hooks.die_in_start, armed just
    before the first kill). The death during recovery is one more failure
    of the same kind: a third core starts, every stream (the one that met
    both deaths included) finishes exactly, and the engine serves on."""

    async def main() -> tuple[list[list[int]], list[int], int, list[str]]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            (victim,) = _alive("SchedulerActor")

            def kill_twice() -> None:
                die_in_start_flag.touch()  # the replacement dies in its start
                os.kill(victim.pid, signal.SIGKILL)

            tokens, _ = await _stream_all(engine, kill_twice)
            await engine.check_health()
            after: list[int] = []
            async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, "after"):
                after += out.outputs[0].token_ids
            actors = [a.actor_id for a in _alive("SchedulerActor")]
            return tokens, after, engine.restarts.total, actors
        finally:
            engine.shutdown()

    tokens, after, restarts, actors = asyncio.run(main())
    assert not die_in_start_flag.exists()  # the replacement met the fault
    assert restarts == 1 and len(actors) == 1
    assert tokens == undisturbed and after == undisturbed[0][:NUM_NEW]


def test_an_engine_killed_while_idle_is_replaced(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """Killed with nothing running, no step notices: the next health check
    (503 once) finds it the first time, the next request's send the second
    time (its replacement killed in turn); each time the engine is
    replaced, and the next request runs exactly."""

    async def main() -> list[tuple[list[int], bool, int]]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        rounds = []
        try:
            await engine.check_health()
            for notice in ("health check", "new request"):
                (victim,) = _alive("SchedulerActor")
                os.kill(victim.pid, signal.SIGKILL)
                reported = False
                if notice == "health check":
                    while not reported:  # the first check after the death reports it
                        try:
                            await engine.check_health()
                        except EngineDeadError:
                            reported = True
                tokens: list[int] = []
                async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, f"next-{len(rounds)}"):
                    tokens += out.outputs[0].token_ids
                await engine.check_health()
                rounds.append((tokens, reported, engine.restarts.total))
            return rounds
        finally:
            engine.shutdown()

    expected = undisturbed[0][:NUM_NEW]
    assert asyncio.run(main()) == [(expected, True, 1), (expected, False, 2)]


def test_a_health_check_that_outlives_its_core_spares_the_new_one(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """Serve's periodic health check begins on a core that is killed; the
    loop replaces the core before the check's answer comes back. That
    answer is about the old core: health rechecks the new one and passes,
    and the loop does not replace a healthy core a second time."""

    async def main() -> tuple[list[int], int]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            client = engine.engine_core
            real_check = client.check_health
            grabbed, answer = threading.Event(), threading.Event()

            def check_on_the_core_of_now() -> None:
                actor = client.actor
                grabbed.set()
                answer.wait()
                ray.get(actor.check_health.remote())

            client.check_health = check_on_the_core_of_now
            stale = asyncio.create_task(engine.check_health())
            await asyncio.to_thread(grabbed.wait)
            client.check_health = real_check
            (victim,) = _alive("SchedulerActor")
            os.kill(victim.pid, signal.SIGKILL)
            async for _ in engine.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, "during"):
                pass
            assert engine.restarts.total == 1
            answer.set()
            await stale
            tokens: list[int] = []
            async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, "after"):
                tokens += out.outputs[0].token_ids
            return tokens, engine.restarts.total
        finally:
            engine.shutdown()

    tokens, restarts = asyncio.run(main())
    assert tokens == undisturbed[0][:NUM_NEW] and restarts == 1


def test_requests_sent_while_the_core_is_replaced_reach_the_new_one(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """A request admitted, and another aborted, while the loop replaces a
    dead core (the replacement held on an event): the new one waits for the
    new core instead of going to the dead one (where it would be lost) or
    blocking the event loop, then runs exactly; the abort ends its stream."""

    async def main() -> tuple[list[int], list[int], str | None, int]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            client = engine.engine_core
            real_restart = client.restart
            entered, proceed = threading.Event(), threading.Event()

            def held_restart(requests: list, shutdown_timeout_s: float) -> None:
                entered.set()
                proceed.wait()
                real_restart(requests, shutdown_timeout_s)

            client.restart = held_restart
            (victim,) = _alive("SchedulerActor")
            first: list[int] = []

            async def consume(request_id: str, prompt: list[int], into: list[int]) -> str | None:
                finish = None
                params = LONG if request_id == "first" else GREEDY
                async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
                    into += out.outputs[0].token_ids
                    finish = out.outputs[0].finish_reason
                    if request_id == "first" and len(into) >= 5 and not entered.is_set():
                        os.kill(victim.pid, signal.SIGKILL)
                return finish

            running = asyncio.create_task(consume("first", PROMPTS[0], first))
            await asyncio.to_thread(entered.wait)
            late: list[int] = []
            arriving = asyncio.create_task(consume("late", PROMPTS[1], late))
            doomed = asyncio.create_task(consume("doomed", PROMPTS[2], []))
            await asyncio.sleep(0)  # both are admitted (their first __anext__ ran)
            await engine.abort("doomed")
            proceed.set()
            await asyncio.wait_for(asyncio.gather(running, arriving), timeout=120)
            return first, late, await asyncio.wait_for(doomed, timeout=120), engine.restarts.total
        finally:
            engine.shutdown()

    first, late, doomed_finish, restarts = asyncio.run(main())
    assert (first, late) == (undisturbed[0], undisturbed[1])
    assert doomed_finish == "abort" and restarts == 1


def test_tensor_parallel_engine_killed_is_rebuilt(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """TP=2, killed twice while it streams. Rank 1 first: rank 0 then waits
    in an all-reduce that would only time out, but the dead rank's channel
    reports the death at once. Then the rebuilt engine's SchedulerActor:
    its client sees the channel close. Each time the whole engine is
    replaced (Ray ends the old scheduler's workers with it; its placement
    group is removed), and the streams finish exactly. One engine meets
    both deaths: a rebuilt engine is as killable as a fresh one."""

    async def stream_and_kill(engine: AsyncLLM, round_: int, victim_name: str) -> list[list[int]]:
        workers = _alive("WorkerActor")
        assert sorted(w.repr_name for w in workers) == ["WorkerActor(rank=0)", "WorkerActor(rank=1)"]
        # This engine's scheduler: the one a round before may not be reported dead yet.
        scheduler = engine.engine_core.actor._actor_id.hex()
        (victim,) = [a for a in workers + _alive("SchedulerActor")
                     if victim_name == a.repr_name or (victim_name == a.class_name and a.actor_id == scheduler)]
        # Rank 1 is not the driver: the driver then blocks in the collective.
        tokens, _ = await _stream_all(engine, lambda: os.kill(victim.pid, signal.SIGKILL), f"r{round_}-")
        assert engine.restarts.total == round_
        assert len(_alive("WorkerActor")) == 2 and not {w.pid for w in workers} & {w.pid for w in _alive("WorkerActor")}
        assert len(_live_groups()) == 1
        return tokens

    async def main() -> list[list[list[int]]]:
        engine = async_llm_from_engine_args(EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2, **ENGINE))
        try:
            return [await stream_and_kill(engine, 1, "WorkerActor(rank=1)"),
                    await stream_and_kill(engine, 2, "SchedulerActor")]
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == [undisturbed, undisturbed]
    for _ in range(300):
        if not _alive("SchedulerActor") and not _alive("WorkerActor"):
            break
        ray.get(ray.remote(lambda: None).remote())
    assert _alive("SchedulerActor") == [] and _alive("WorkerActor") == []
    assert _live_groups() == []


def test_a_request_that_fails_its_step_fails_alone(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """A request whose step raises on a live worker (fault_hooks.py) gets
    an error of its own; the engine is replaced and every other stream
    finishes exactly; the engine serves on."""

    async def main() -> tuple[list[list[int]], BaseException | None, int, list[int]]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
        )
        try:
            tokens: list[list[int]] = [[] for _ in PROMPTS]
            poisoned: list[BaseException] = []

            async def consume(i: int) -> None:
                async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS[i], f"r{i}"):
                    tokens[i] += out.outputs[0].token_ids
                    if i == 0 and len(tokens[0]) >= 5 and not poisoned:
                        poisoned.append(asyncio.ensure_future(poison()))  # type: ignore[arg-type]

            async def poison() -> BaseException | None:
                params = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8)
                try:
                    async for _ in engine.generate({"prompt_token_ids": [11, 12, 13]}, params, "poisoned"):
                        pass
                except RequestFailedError as e:
                    return e
                return None

            await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
            error = await poisoned[0]  # type: ignore[misc]
            after = []
            async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, "after"):
                after += out.outputs[0].token_ids
            return tokens, error, engine.restarts.total, after
        finally:
            engine.shutdown()

    tokens, error, restarts, after = asyncio.run(main())
    assert isinstance(error, RequestFailedError)
    assert restarts == 1
    assert tokens == undisturbed and after == undisturbed[0][:NUM_NEW]


def test_a_hung_step_ends_the_engine_and_the_requests_resume(
    ray_local: None, hang_flag: Path, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """A step that never returns (fault_hooks.hang_once, a live but wedged
    worker): after step_timeout_s the engine is ended and replaced, and
    every stream, the one that met the hang included, finishes."""

    async def main() -> tuple[list[list[int]], int, int]:
        engine = async_llm_from_engine_args(
            EngineArgs(model=str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE), step_timeout_s=3.0
        )
        try:
            tokens: list[list[int]] = [[] for _ in PROMPTS]
            hung: list[int] = []

            async def consume(i: int) -> None:
                async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS[i], f"r{i}"):
                    tokens[i] += out.outputs[0].token_ids
                    if i == 0 and len(tokens[0]) >= 5 and not hung:
                        hung.append(0)
                        await hanging()

            async def hanging() -> None:
                params = SamplingParams(temperature=1.0, seed=HANG_SEED, max_tokens=8, ignore_eos=True)
                async for out in engine.generate({"prompt_token_ids": [11, 12, 13]}, params, "hanging"):
                    hung[0] += len(out.outputs[0].token_ids)

            await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
            return tokens, hung[0], engine.restarts.total
        finally:
            engine.shutdown()

    tokens, hanging_tokens, restarts = asyncio.run(main())
    assert hang_flag.exists() and restarts == 1
    assert hanging_tokens == 8
    assert tokens == undisturbed


def test_a_dead_dp_rank_is_rebuilt_alone(ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]) -> None:
    """DP=2: DP rank 1's WorkerActor killed mid-generation. The engine is not
    restarted (same SchedulerActor, no core replaced): rank 1's group alone
    is rebuilt and its requests resume by recompute, while rank 0 keeps its
    worker; every stream equals an undisturbed run."""

    async def main() -> tuple[list[list[int]], int]:
        engine = async_llm_from_engine_args(EngineArgs(model=str(tiny_model_dir), data_parallel_size=2, **ENGINE))
        try:
            (scheduler,) = _alive("SchedulerActor")
            workers = {w.repr_name: w for w in _alive("WorkerActor")}
            assert sorted(workers) == ["WorkerActor(rank=0, dp_rank=0)", "WorkerActor(rank=0, dp_rank=1)"]
            tokens: list[list[int]] = [[] for _ in PROMPTS]
            killed: list[int] = []

            async def consume(i: int) -> None:
                async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS[i], f"r{i}"):
                    tokens[i] += out.outputs[0].token_ids
                    if len(tokens[i]) >= 5 and not killed:
                        killed.append(workers["WorkerActor(rank=0, dp_rank=1)"].pid)
                        os.kill(killed[0], signal.SIGKILL)

            await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
            await engine.check_health()
            await engine.refresh_stats()
            rebuilds = [
                float(line.rsplit(" ", 1)[1]) for line in engine.metrics.render()[0].decode().splitlines()
                if line.startswith("rayvllm:dp_rank_rebuilds_total")
            ]
            assert rebuilds == [1.0]
            assert engine.engine_core.make_stats().num_rank_rebuilds == 1
            after = {w.repr_name: w.pid for w in _alive("WorkerActor")}
            assert after["WorkerActor(rank=0, dp_rank=0)"] == workers["WorkerActor(rank=0, dp_rank=0)"].pid
            assert after["WorkerActor(rank=0, dp_rank=1)"] != killed[0]
            assert [a.actor_id for a in _alive("SchedulerActor")] == [scheduler.actor_id]
            return tokens, engine.restarts.total
        finally:
            engine.shutdown()

    tokens, restarts = asyncio.run(main())
    assert restarts == 0
    assert tokens == undisturbed


def test_the_offline_llm_on_ray_replaces_a_killed_engine(
    ray_local: None, tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """The offline engine on Ray takes the serving engine's path: the
    SchedulerActor killed between two steps is replaced, and every request
    ends with the undisturbed tokens."""
    llm = LLM(str(tiny_model_dir), distributed_executor_backend="ray", **ENGINE)
    try:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PARAMS[i])
        finals: dict[str, list[int]] = {}
        steps = 0
        (victim,) = _alive("SchedulerActor")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 6:
                os.kill(victim.pid, signal.SIGKILL)
        assert engine.restarts is not None and engine.restarts.total == 1
        (successor,) = _alive("SchedulerActor")
        assert successor.actor_id != victim.actor_id
    finally:
        llm.shutdown()
    assert [finals[f"r{i}"] for i in range(len(PROMPTS))] == undisturbed
