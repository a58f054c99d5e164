"""Pausing and sleeping (docs/RL.md). Pausing generation with streams in flight, over the
in-process `AsyncLLM`: "abort" ends them with their tokens so far, "wait"
lets them finish, "keep" freezes them and they go on after the resume with
the tokens of an undisturbed run (with `clear_cache` too: their KV is
recomputed); a weight update while frozen continues each request as a
fresh engine on the new weights would. Requests that arrive while paused
wait, then run. Sleep at both levels gives the KV cache's memory back to
the OS (the process's RSS drops by its size) and wakes to the same greedy
tokens; weights synced while asleep serve after the wake."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rayvllm import LLM, SamplingParams
from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM, RequestStream
from rayvllm.messages.errors import InvalidParameterError
from rl_oracle import save_weights, trained_weights

ENGINE = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=4 << 20)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
LATE = [30, 31, 32]
# Long enough that no stream can finish between its first output and the pause.
MAX_TOKENS = 96
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

T = TypeVar("T")


def _run(model_dir: Path, body: Callable[[AsyncLLM], Awaitable[T]]) -> T:
    async def main() -> T:
        engine = async_llm_from_engine_args(EngineArgs(model=str(model_dir), **ENGINE))
        try:
            return await body(engine)
        finally:
            engine.shutdown()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir: Path) -> list[list[int]]:
    llm = LLM(model=str(tiny_model_dir), **ENGINE)
    outs = llm.generate(PROMPTS + [LATE], GREEDY, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


async def _started(engine: AsyncLLM) -> tuple[list[RequestStream], list[list[int]]]:
    """The prompts' streams, each past its first output."""
    streams = [engine.add_request({"prompt_token_ids": p}, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)]
    tokens = [list((await s.__anext__()).outputs[0].token_ids) for s in streams]
    return streams, tokens


async def _rest(stream: RequestStream, tokens: list[int]) -> tuple[list[int], str | None]:
    """Read a stream to its end: all its tokens and its finish reason."""
    reason = None
    async for out in stream:
        tokens += out.outputs[0].token_ids
        reason = out.outputs[0].finish_reason
    await stream.aclose()
    return tokens, reason


async def _late_request_waits(engine: AsyncLLM) -> tuple[RequestStream, list[int]]:
    """A request made while paused: admitted, but held from the core until the resume."""
    late = engine.add_request({"prompt_token_ids": LATE}, GREEDY, "late")
    assert engine.is_paused() and "late" in engine._held
    return late, []


def test_abort_ends_streams_with_their_tokens_so_far(tiny_model_dir: Path, undisturbed: list[list[int]]) -> None:
    async def body(engine: AsyncLLM) -> None:
        streams, tokens = await _started(engine)
        await engine.pause_generation(mode="abort")
        for stream, so_far, full in zip(streams, tokens, undisturbed):
            got, reason = await _rest(stream, so_far)
            assert reason == "abort" and len(got) < MAX_TOKENS and got == full[: len(got)]
        late, late_tokens = await _late_request_waits(engine)
        await engine.resume_generation()
        assert not engine.is_paused()
        assert (await _rest(late, late_tokens)) == (undisturbed[-1], "length")

    _run(tiny_model_dir, body)


def test_wait_drains_then_pauses(tiny_model_dir: Path, undisturbed: list[list[int]]) -> None:
    async def body(engine: AsyncLLM) -> None:
        streams, tokens = await _started(engine)
        await engine.pause_generation(mode="wait")
        # Every request in flight finished before the pause returned.
        assert engine.output_processor.get_num_unfinished_requests() == 0
        for stream, so_far, full in zip(streams, tokens, undisturbed):
            assert (await _rest(stream, so_far)) == (full, "length")
        late, late_tokens = await _late_request_waits(engine)
        await engine.resume_generation()
        assert (await _rest(late, late_tokens)) == (undisturbed[-1], "length")

    _run(tiny_model_dir, body)


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_freezes_and_goes_on_unchanged(tiny_model_dir: Path, undisturbed: list[list[int]], clear_cache: bool) -> None:
    async def body(engine: AsyncLLM) -> None:
        streams, tokens = await _started(engine)
        await engine.pause_generation(mode="keep", clear_cache=clear_cache)
        core = engine.engine_core.engine_core  # type: ignore[attr-defined]
        assert core.paused and not core.has_work() and len(core.request_rank) == len(PROMPTS)
        late, late_tokens = await _late_request_waits(engine)
        await engine.resume_generation()
        for stream, so_far, full in zip(streams, tokens, undisturbed):
            assert (await _rest(stream, so_far)) == (full, "length")
        assert (await _rest(late, late_tokens)) == (undisturbed[-1], "length")

    _run(tiny_model_dir, body)


def test_keep_with_a_weight_update_continues_on_the_new_weights(
    tiny_model_dir: Path, undisturbed: list[list[int]], tmp_path: Path
) -> None:
    """Frozen requests, new weights, cache cleared: each request goes on as
    a fresh engine on the new weights continues its prompt plus the tokens
    it had (its KV recomputed under the new weights)."""
    trained = trained_weights(tiny_model_dir, seed=5)

    async def body(engine: AsyncLLM) -> tuple[list[int], list[list[int]]]:
        streams, tokens = await _started(engine)
        await engine.pause_generation(mode="keep", clear_cache=True)
        # Frozen between steps: what each request holds now is exactly what
        # the old weights made (some of it may not have reached its stream).
        core = engine.engine_core.engine_core  # type: ignore[attr-defined]
        made = [len(core.scheduler.requests[f"r{i}"].output_token_ids) for i in range(len(PROMPTS))]
        await engine.sync_weights(trained, backend="ray")
        await engine.resume_generation()
        return made, [(await _rest(s, t))[0] for s, t in zip(streams, tokens)]

    made, after = _run(tiny_model_dir, body)
    fresh = LLM(model=str(save_weights(tiny_model_dir, trained, tmp_path / "trained")), **ENGINE)
    for prompt, split, full, before in zip(PROMPTS, made, after, undisturbed):
        assert 0 < split < MAX_TOKENS and len(full) == MAX_TOKENS
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - split, ignore_eos=True)
        # The old weights' tokens up to the pause, the new weights' after it.
        assert before[:split] == full[:split]
        assert fresh.generate([prompt + full[:split]], params, use_tqdm=False)[0].outputs[0].token_ids == full[split:]
    fresh.shutdown()


def test_unknown_mode_is_refused(tiny_model_dir: Path) -> None:
    async def body(engine: AsyncLLM) -> None:
        with pytest.raises(InvalidParameterError, match="mode"):
            await engine.pause_generation(mode="later")
        assert not engine.is_paused()

    _run(tiny_model_dir, body)


# ---- sleep and wake ---------------------------------------------------------------

# A KV cache of 16,385 blocks (128 sequences of 2,048 tokens): 4 tensors
# of 64 MiB, large enough that the drop stands far out of the RSS's noise.
SLEEPY = dict(max_num_seqs=128, max_model_len=2048, kv_cache_memory_bytes=256 << 20)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def sleepy(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model_dir), **SLEEPY)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_memory_and_wakes_to_the_same_tokens(
    sleepy: LLM, level: int, undisturbed: list[list[int]]
) -> None:
    prompts = PROMPTS + [LATE]
    assert [list(o.outputs[0].token_ids) for o in sleepy.generate(prompts, GREEDY, use_tqdm=False)] == undisturbed
    runner = sleepy.llm_engine.engine_core.engine_core.executor.runner  # type: ignore[attr-defined]
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    assert kv_bytes >= 250 << 20
    awake = _rss()
    sleepy.sleep(level=level)
    assert sleepy.is_sleeping()
    # The KV cache's memory left the process.
    assert awake - _rss() > 0.9 * kv_bytes
    assert runner.kv_caches == [] and (runner.model is None) == (level == 2)
    with pytest.raises(InvalidParameterError, match="asleep"):
        sleepy.generate(prompts, GREEDY, use_tqdm=False)
    if level == 2:
        with pytest.raises(InvalidParameterError, match="weights before the KV cache"):
            sleepy.wake_up(tags=["kv_cache"])
        sleepy.wake_up(tags=["weights"])
        assert sleepy.is_sleeping()
    sleepy.wake_up(tags=["kv_cache"] if level == 2 else None)
    assert not sleepy.is_sleeping()
    assert [list(o.outputs[0].token_ids) for o in sleepy.generate(prompts, GREEDY, use_tqdm=False)] == undisturbed


def test_weights_synced_while_asleep_serve_after_the_wake(
    sleepy: LLM, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Level 2, then the trainer's weights arrive by transfer: the wake
    keeps them (no reload from the checkpoint)."""
    trained = trained_weights(tiny_model_dir, seed=9)
    fresh = LLM(model=str(save_weights(tiny_model_dir, trained, tmp_path / "trained")), **ENGINE)
    expected = [list(o.outputs[0].token_ids) for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]
    fresh.shutdown()
    sleepy.sleep(level=2)
    sleepy.sync_weights(trained, backend="gloo")
    sleepy.wake_up()
    assert [list(o.outputs[0].token_ids) for o in sleepy.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    sleepy.sync_weights(trained_weights(tiny_model_dir, seed=9, scale=0.0))  # back, for any test after


def test_async_sleep_holds_requests_until_the_wake(tiny_model_dir: Path, undisturbed: list[list[int]]) -> None:
    async def body(engine: AsyncLLM) -> None:
        await engine.sleep(level=1)
        assert engine.is_sleeping()
        late = engine.add_request({"prompt_token_ids": LATE}, GREEDY, "late")
        await engine.wake_up()
        assert not engine.is_sleeping()
        assert (await _rest(late, [])) == (undisturbed[-1], "length")

    _run(tiny_model_dir, body)


def test_a_weight_transfer_group_that_does_not_form_holds_no_request(
    tiny_model_dir: Path, undisturbed: list[list[int]]
) -> None:
    """A gloo init whose group lacks a member waits beside the steps: a
    request runs to its end meanwhile, a call that needs the workers fails
    at once naming the init, one that does not runs; the init returns once
    the last member joins. A group whose host never answers is an error
    naming `timeout_s` after a bounded wait, and the engine serves on."""
    from concurrent.futures import ThreadPoolExecutor

    from rayvllm.distributed.weight_transfer import TransferGroup
    from rayvllm.utils.network import free_port

    async def body(engine: AsyncLLM) -> None:
        port = free_port()
        with ThreadPoolExecutor(2) as pool:
            # The trainer (rank 0) waits for ranks 1 (the engine) and 2 (nobody yet).
            trainer = pool.submit(TransferGroup, "gloo", "127.0.0.1", port, 0, 3, 120.0)
            init = asyncio.ensure_future(engine.init_weight_transfer_engine(
                "gloo", master_address="127.0.0.1", master_port=port, world_size=3, timeout_s=120.0
            ))
            late, late_tokens = engine.add_request({"prompt_token_ids": LATE}, GREEDY, "during-init"), []
            assert (await _rest(late, late_tokens)) == (undisturbed[-1], "length")
            assert not init.done()  # rank 2 has not joined: the group cannot have formed
            with pytest.raises(InvalidParameterError, match="init_weight_transfer_engine returns"):
                await engine.collective_rpc("is_sleeping_probe")
            assert await engine.reset_prefix_cache() is True
            last = pool.submit(TransferGroup, "gloo", "127.0.0.1", port, 2, 3, 120.0)
            await init
            trainer.result().close()
            last.result().close()
        with pytest.raises(InvalidParameterError, match=r"init_info: the gloo group at 127\.0\.0\.1:1 .*timeout_s=1"):
            await engine.init_weight_transfer_engine(
                "gloo", master_address="127.0.0.1", master_port=1, world_size=2, timeout_s=1.0
            )
        again = engine.add_request({"prompt_token_ids": LATE}, GREEDY, "after-init")
        assert (await _rest(again, [])) == (undisturbed[-1], "length")

    _run(tiny_model_dir, body)
