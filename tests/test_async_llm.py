"""The asyncio engine loop (`AsyncLLM`) over the in-process core: concurrent
streams equal the offline engine, early exits abort and free KV blocks,
admission and failures surface as the documented errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from rayvllm import LLM, SamplingParams
from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM, RequestStream
from rayvllm.messages.errors import EngineDeadError, EngineOverloadedError, PromptTooLongError
from rayvllm.messages.outputs import CompletionOutput, Logprob, RequestOutput, RequestOutputKind

ENGINE = dict(max_num_seqs=8, max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64)
PROMPTS = [[5, 6, 7, 8, 9] * k for k in (1, 3, 7, 12)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

T = TypeVar("T")


def _run(model_dir: Path, body: Callable[[AsyncLLM], Awaitable[T]], **kwargs: Any) -> T:
    async def main() -> T:
        engine = async_llm_from_engine_args(EngineArgs(model=str(model_dir), **ENGINE), **kwargs)
        try:
            return await body(engine)
        finally:
            engine.shutdown()

    return asyncio.run(main())


async def _collect(engine: AsyncLLM, prompt: list[int], request_id: str, params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        tokens += out.outputs[0].token_ids
    return tokens


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> list[list[int]]:
    llm = LLM(model=str(tiny_model_dir), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_concurrent_streams_equal_offline(tiny_model_dir: Path, offline: list[list[int]]) -> None:
    async def body(engine: AsyncLLM) -> list[list[int]]:
        return list(await asyncio.gather(*(_collect(engine, p, f"r{i}") for i, p in enumerate(PROMPTS))))

    assert _run(tiny_model_dir, body) == offline


def test_leaving_a_stream_aborts_and_frees_blocks(tiny_model_dir: Path, offline: list[list[int]]) -> None:
    async def body(engine: AsyncLLM) -> tuple[list[int], list[int], Any]:
        long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        stream = engine.generate({"prompt_token_ids": PROMPTS[3]}, long, "leaver")
        first = await anext(stream)
        await stream.aclose()  # what a dropped HTTP client does
        # The abort reaches the core with the next step, which this request runs.
        other = await _collect(engine, PROMPTS[0], "stayer")
        stats = engine.engine_core.make_stats()
        return first.outputs[0].token_ids, other, stats

    first, other, stats = _run(tiny_model_dir, body)
    # The first output holds every token made before the stream was read: on
    # a busy machine the step thread can run past the offline run's 12.
    shared = min(len(first), len(offline[3]))
    assert first[:shared] == offline[3][:shared] and other == offline[0]
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_abort_ends_the_stream_with_abort(tiny_model_dir: Path) -> None:
    async def body(engine: AsyncLLM) -> list[RequestOutput]:
        long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        outs = []
        async for out in engine.generate({"prompt_token_ids": PROMPTS[1]}, long, "victim"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("victim")
        return outs

    outs = _run(tiny_model_dir, body)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < 150


def test_validation_errors_raise_before_the_first_output(tiny_model_dir: Path) -> None:
    async def body(engine: AsyncLLM) -> None:
        with pytest.raises(PromptTooLongError):
            await anext(engine.generate({"prompt_token_ids": [5] * 300}, GREEDY, "too-long"))
        assert engine.num_pending_requests() == 0

    _run(tiny_model_dir, body)


def test_add_request_admits_at_once(tiny_model_dir: Path, offline: list[list[int]]) -> None:
    """Eager admission: `add_request` validates and admits on the spot (no
    await, so the engine loop has not run and no token exists yet); errors
    raise from the call itself; the stream then yields what `generate` would,
    and a stream closed unread aborts its request."""

    async def body(engine: AsyncLLM) -> tuple[list[int], Any]:
        with pytest.raises(PromptTooLongError):
            engine.add_request({"prompt_token_ids": [5] * 300}, GREEDY, "too-long")
        stream = engine.add_request({"prompt_token_ids": PROMPTS[2]}, GREEDY, "eager")
        dropped = engine.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY, "dropped")
        assert engine.num_pending_requests() == 2  # both admitted before any step ran
        await dropped.aclose()
        tokens = [t async for out in stream for t in out.outputs[0].token_ids]
        await stream.aclose()
        # One more request steps the engine past the abort of the dropped one.
        await _collect(engine, PROMPTS[0], "after")
        return tokens, engine.engine_core.make_stats()

    tokens, stats = _run(tiny_model_dir, body)
    assert tokens == offline[2]
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_overload_is_refused(tiny_model_dir: Path) -> None:
    async def body(engine: AsyncLLM) -> list[int]:
        first = engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, "a")
        tokens = (await anext(first)).outputs[0].token_ids
        with pytest.raises(EngineOverloadedError):
            await anext(engine.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, "b"))
        async for out in first:
            tokens += out.outputs[0].token_ids
        return tokens

    assert len(_run(tiny_model_dir, body, max_pending_requests=1)) == 12


def test_queued_prompt_tokens_are_bounded(tiny_model_dir: Path) -> None:
    """`max_pending_prompt_tokens` counts prompts admitted with no output
    yet: a request that would pass it is refused (503) while the first one
    waits for prefill, and admitted once that one's first token is out."""
    first_prompt, second_prompt = PROMPTS[0], PROMPTS[1]
    limit = len(first_prompt) + len(second_prompt) - 1

    async def body(engine: AsyncLLM) -> list[int]:
        first = engine.add_request({"prompt_token_ids": first_prompt}, GREEDY, "a")
        with pytest.raises(EngineOverloadedError, match="max_pending_prompt_tokens"):
            engine.add_request({"prompt_token_ids": second_prompt}, GREEDY, "b")
        tokens = list((await anext(first)).outputs[0].token_ids)
        second = engine.add_request({"prompt_token_ids": second_prompt}, GREEDY, "b")
        async for out in first:
            tokens += out.outputs[0].token_ids
        await first.aclose()
        assert len([t async for out in second for t in out.outputs[0].token_ids]) == 12
        await second.aclose()
        return tokens

    assert len(_run(tiny_model_dir, body, max_pending_prompt_tokens=limit)) == 12


def test_n_and_final_only(tiny_model_dir: Path) -> None:
    async def body(engine: AsyncLLM) -> tuple[list[RequestOutput], dict[int, list[int]]]:
        params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True)
        finals = [
            o async for o in engine.generate(
                {"prompt_token_ids": PROMPTS[0]}, params, "final", output_kind=RequestOutputKind.FINAL_ONLY
            )
        ]
        deltas: dict[int, list[int]] = {0: [], 1: []}
        async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "delta"):
            for c in out.outputs:
                deltas[c.index] += c.token_ids
        return finals, deltas

    finals, deltas = _run(tiny_model_dir, body)
    assert len(finals) == 1 and finals[0].finished
    assert {c.index: c.token_ids for c in finals[0].outputs} == deltas  # same seed, same tokens
    assert all(len(t) == 6 for t in deltas.values())


def test_a_failing_step_fails_every_stream_and_health(tiny_model_dir: Path) -> None:
    async def body(engine: AsyncLLM) -> None:
        await engine.check_health()

        def broken() -> None:
            raise RuntimeError("worker exploded")

        engine.engine_core.step = broken  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError, match="worker exploded"):
            await _collect(engine, PROMPTS[0], "doomed")
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await anext(engine.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, "after"))

    _run(tiny_model_dir, body)


class _Released:
    """The engine side a `RequestStream` calls when it closes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def _release(self, request_id: str, finished: bool) -> None:
        self.calls.append((request_id, finished))


def _delta(step: int, finished: bool = False, n: int = 2) -> RequestOutput:
    outputs = [
        CompletionOutput(i, f"<{i}.{step}>", [100 * i + step], -float(step),
                         [{100 * i + step: Logprob(-float(step))}], "length" if finished else None)
        for i in range(n)
    ]
    return RequestOutput("r", None, [1, 2], [None] if step == 0 else None, outputs, finished, num_cached_tokens=0)


def test_a_stream_that_falls_behind_gets_what_accumulated_as_one_output() -> None:
    """Three DELTA outputs waiting are read as one (text, ids and logprobs
    joined per sequence, totals and finish from the newest); an engine error
    queued behind them comes after them; the text is the same as read one by one."""

    async def main() -> None:
        engine = _Released()
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(engine, "r", queue)  # type: ignore[arg-type]
        for step in range(3):
            queue.put_nowait(_delta(step))
        merged = await stream.__anext__()
        assert [o.text for o in merged.outputs] == ["<0.0><0.1><0.2>", "<1.0><1.1><1.2>"]
        assert [o.token_ids for o in merged.outputs] == [[0, 1, 2], [100, 101, 102]]
        assert [list(lp) for lp in merged.outputs[1].logprobs] == [[100], [101], [102]]
        assert merged.outputs[0].cumulative_logprob == -2.0 and merged.prompt_logprobs == [None]
        queue.put_nowait(_delta(3))
        queue.put_nowait(_delta(4, finished=True))
        queue.put_nowait(_delta(5))  # never read: the request finished before it
        last = await stream.__anext__()
        assert last.finished and [o.text for o in last.outputs] == ["<0.3><0.4>", "<1.3><1.4>"]
        assert [o.finish_reason for o in last.outputs] == ["length", "length"]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        await stream.aclose()
        assert engine.calls == [("r", True)]

        failing = RequestStream(engine, "s", asyncio.Queue())  # type: ignore[arg-type]
        failing._queue.put_nowait(_delta(0))
        failing._queue.put_nowait(EngineDeadError("gone"))
        assert (await failing.__anext__()).outputs[0].text == "<0.0>"
        with pytest.raises(EngineDeadError):
            await failing.__anext__()

    asyncio.run(main())


def test_a_cumulative_stream_that_falls_behind_gets_the_newest_output() -> None:
    async def main() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream(_Released(), "r", queue, RequestOutputKind.CUMULATIVE)  # type: ignore[arg-type]
        newest = _delta(7)
        queue.put_nowait(_delta(6))
        queue.put_nowait(newest)
        assert await stream.__anext__() is newest

    asyncio.run(main())
