"""The asyncio engine loop for serving: Processor -> engine core client -> OutputProcessor.

`AsyncLLM.generate` is an async generator of DELTA `RequestOutput`s; many
run at once and one background task takes the core's outputs for all of
them (the core steps in its own loop, core_loop.py).

Threading invariant: the Processor, the OutputProcessor and the per-request
queues are touched only on the event loop; the client's outputs are read
only on one dedicated step thread, which waits for the core loop's pushes,
so a blocking wait never stalls the HTTP server. New requests and aborts reach
the core in arrival order: the loop hands them to the engine core client
(core_client.py) the moment it has them, from the event loop, while the
step thread waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.core.replica_router import ReplicaLoad, encode_report
from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.engine.restart_policy import RestartPolicy
from rayvllm.engine.weight_sync import sync_weights
from rayvllm.frontend.metrics import EngineMetrics
from rayvllm.frontend.output_processor import OutputProcessor, mark_final_only
from rayvllm.frontend.processor import Processor, PromptType
from rayvllm.messages.block_hash import cached_prefix_tokens, prefix_routing_keys, request_extra_keys
from rayvllm.messages.engine_types import EngineCoreOutput, SchedulerStats
from rayvllm.messages.errors import EngineDeadError, EngineOverloadedError, InvalidParameterError, RequestFailedError
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.resume import ResumePoint
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.weight_update import WeightUpdateInfo
from rayvllm.utils.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

# A step that has not returned after this long means the engine is wedged
# (a forward takes milliseconds, a cold prefill seconds); vLLM's
# VLLM_ENGINE_ITERATION_TIMEOUT_S is the same default.
STEP_TIMEOUT_S = 60.0
# Scheduler stats cost a round trip on the Ray path; gauges need no more.
STATS_INTERVAL_S = 1.0

# `pause_generation`'s modes (vLLM's).
PAUSE_MODES = ("abort", "wait", "keep")

# What a request's stream yields: generation outputs, or a pooling request's one output.
EngineOutput = RequestOutput | PoolingRequestOutput


class RequestStream:
    """The outputs of one admitted request, in order, until it finishes.

    Invariant: after `aclose()` (idempotent) the engine holds nothing of the
    request: a stream closed before its last output aborts the request. An
    engine failure is raised from `__anext__` to every open stream.

    A consumer that falls behind gets what has accumulated as one output
    (vLLM's `stream_interval`, adaptive): DELTA outputs waiting in the queue
    are merged (`RequestOutput.merged_with`), CUMULATIVE ones give way to
    the newest; the text and token counts are the same either way."""

    def __init__(
        self, engine: "AsyncLLM", request_id: str, queue: "asyncio.Queue[EngineOutput | BaseException]",
        kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self._kind = kind
        self._error: BaseException | None = None
        self._finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> EngineOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        item = self._error or await self._queue.get()
        if isinstance(item, BaseException):
            self._finished = True  # the engine is gone; nothing left to abort
            raise item
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, BaseException):
                self._error = later  # after what came before it
                break
            assert isinstance(later, RequestOutput)
            item = item.merged_with(later) if self._kind is RequestOutputKind.DELTA else later
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._release(self.request_id, self._finished)


class AsyncLLM:
    """Serving front of the engine. `max_pending_requests` bounds user
    requests admitted but unfinished, `max_pending_prompt_tokens` the prompt
    tokens of admitted requests with no output yet (n copies counted n
    times; a FINAL_ONLY request, whose first output is its last, until it
    ends; a request is always admitted into an empty queue); None: no
    bound. Beyond either, `add_request` raises `EngineOverloadedError`
    (HTTP 503). A step still running after
    `step_timeout_s` is taken for a hang: the engine is ended (a Ray engine
    is then replaced and its requests resumed) and health says so.
    `engine_core`: the client of the core it serves, started (which kind
    is chosen above this package: rayvllm.actors.factory)."""

    def __init__(
        self, config: EngineConfig, engine_core: EngineCoreClient, max_pending_requests: int | None = None,
        step_timeout_s: float | None = None, max_pending_prompt_tokens: int | None = None,
    ) -> None:
        self.config = config
        self.engine_core = engine_core
        self.model_config = config.model_config
        self.served_model_name = config.model_config.served_model_name or config.model_config.model
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        self.processor = Processor(
            config.model_config, self.tokenizer, max_logprobs=config.max_logprobs,
            max_n=config.scheduler_config.max_num_seqs, lora_config=config.lora_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        spec = config.speculative_config
        self.metrics = EngineMetrics(
            self.served_model_name,
            max_model_len=config.model_config.max_model_len,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        )
        self.max_pending_requests = max_pending_requests
        self.max_pending_prompt_tokens = max_pending_prompt_tokens
        # Prompt tokens per admitted user request with no output yet, and their sum.
        self._unprefilled: dict[str, list[EngineCoreRequest]] = {}
        self._unprefilled_tokens = 0
        # Their prompts' prefix routing keys, worked out once, at the first `load()`.
        self._prefix_keys: dict[str, list[list[bytes]]] = {}
        self.step_timeout_s = STEP_TIMEOUT_S if step_timeout_s is None else step_timeout_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayvllm-engine-step")
        self._queues: dict[str, asyncio.Queue[EngineOutput | BaseException]] = {}
        self._started: set[str] = set()  # user requests whose prompt tokens were counted
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._watchdog_task: asyncio.Task[None] | None = None
        self._step_started: float | None = None
        self._last_stats = 0.0
        self.restarts = RestartPolicy(self.engine_core, self.output_processor)
        self._core_failure: EngineDeadError | None = None
        self.dead_error: BaseException | None = None
        self._closed = False
        # Paused (`pause_generation`): new requests are admitted but held
        # here (user id -> its engine-core requests) until resumed; frozen
        # (mode "keep"): the core schedules nothing, so no step is awaited.
        self._paused = False
        self._frozen = False
        # Asleep (`sleep`): the core schedules nothing either, until its KV cache wakes.
        self._asleep = False
        self._held: dict[str, list[EngineCoreRequest]] = {}
        self._stepped: asyncio.Event | None = None

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    # ---- requests -----------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        resume: ResumePoint | None = None,
        final_only: bool = False,
    ) -> RequestStream:
        """Validate and admit the request now, on the event loop, and return
        its stream: invalid input, overload or a dead engine raise here,
        before any token is computed, so a server can answer with an error
        status, or send a streaming response's headers at once. The caller
        owns the stream and must `aclose()` it (closing before the end
        aborts the request). `resume`: the request continues a stream that
        another engine began (n=1, DELTA outputs): its outputs start after
        the tokens and text the client has (`ResumePoint`). `final_only`
        as for `LLMEngine.add_request`: the caller reads only the finished
        output (a batch row, a handle's `generate`), and an aborted
        request's output holds its first token alone."""
        self._ensure_running()
        if request_id in self._queues:
            raise InvalidParameterError("request_id", f"request {request_id!r} is already running")
        if self.max_pending_requests is not None and len(self._queues) >= self.max_pending_requests:
            raise EngineOverloadedError(
                f"{len(self._queues)} requests are already pending (max_pending_requests="
                f"{self.max_pending_requests}); retry later"
            )
        core_reqs, prompt_text = self.processor.process_with_fanout(
            request_id, prompt, params, priority=priority, add_special_tokens=add_special_tokens,
            lora_request=lora_request,
        )
        if resume is not None:
            _resume_at(core_reqs, resume, output_kind, self.max_model_len)
        if final_only:
            core_reqs = mark_final_only(core_reqs, output_kind)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in core_reqs)
        limit = self.max_pending_prompt_tokens
        if limit is not None and self._unprefilled and self._unprefilled_tokens + prompt_tokens > limit:
            raise EngineOverloadedError(
                f"{self._unprefilled_tokens} prompt tokens are already waiting for prefill "
                f"(max_pending_prompt_tokens={limit}); retry later"
            )
        self.output_processor.add_fanout(
            request_id, core_reqs, prompt_text, output_kind, sent_text_chars=resume.text_chars if resume else 0
        )
        queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._unprefilled[request_id] = core_reqs
        self._unprefilled_tokens += prompt_tokens
        if self._paused:
            self._held[request_id] = core_reqs
            return RequestStream(self, request_id, queue, output_kind)
        try:
            # While the core is replaced the client holds it for the new one.
            self.engine_core.add_requests(core_reqs)
        except EngineDeadError as e:
            # The core died while idle; the request stays in the table and
            # goes to the new core with the others.
            self._core_failed(e)
        except BaseException:
            self._queues.pop(request_id, None)
            self._prefilled(request_id)
            self.output_processor.abort_requests(self.output_processor.child_request_ids([request_id]))
            raise
        self._wake()
        return RequestStream(self, request_id, queue, output_kind)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        resume: ResumePoint | None = None,
        final_only: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs (DELTA by default; FINAL_ONLY yields
        the finished output alone) until it finishes: `add_request`, then
        its stream. Leaving the generator early (`aclose`, cancellation, a
        dropped client) aborts the request, which frees its KV blocks at
        the next step. `resume` and `final_only` as for `add_request`."""
        stream = self.add_request(
            prompt, params, request_id, add_special_tokens=add_special_tokens, priority=priority,
            output_kind=output_kind, lora_request=lora_request, resume=resume, final_only=final_only,
        )
        try:
            async for out in stream:
                assert isinstance(out, RequestOutput)
                yield out
        finally:
            await stream.aclose()

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, *, add_special_tokens: bool = True
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Yield a pooling request's one output (vLLM's name for pooling
        through the async engine); leaving early aborts it."""
        stream = self.add_request(prompt, pooling_params, request_id, add_special_tokens=add_special_tokens)
        try:
            async for out in stream:
                if isinstance(out, PoolingRequestOutput):
                    yield out
        finally:
            await stream.aclose()

    def _release(self, request_id: str, finished: bool) -> None:
        """A stream's end: forget its queue, and abort it unless it finished."""
        self._queues.pop(request_id, None)
        self._prefilled(request_id)
        if not finished:
            self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a running request; its stream ends with finish_reason "abort"."""
        self._abort_now(request_id, notify=True)

    def _abort_now(self, request_id: str, notify: bool = False) -> None:
        self._held.pop(request_id, None)
        ids = self.output_processor.child_request_ids([request_id])
        if not ids:
            return
        for out in self.output_processor.abort_requests(ids):
            self._deliver(out, notify)
        self._abort_in_core(ids)

    def _abort_in_core(self, ids: list[str]) -> None:
        try:
            self.engine_core.abort_requests(ids)
        except EngineDeadError:
            pass  # a dead core holds nothing to free; the loop reports the death
        self._wake()

    # ---- the loop -----------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead_error!r}")
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._stepped = asyncio.Event()
            loop = asyncio.get_running_loop()
            self._loop_task = loop.create_task(self._run(), name="rayvllm-engine-loop")
            self._watchdog_task = loop.create_task(self._watch_steps(), name="rayvllm-step-watchdog")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _has_work(self) -> bool:
        """Something the core will push for: a held request or a frozen
        core's never would, and a step awaited for them would hang."""
        return (
            self._core_failure is not None
            or self.engine_core.has_pending_intake()
            or (not self._frozen and not self._asleep and self._num_in_core() > 0)
        )

    def _num_in_core(self) -> int:
        """Unfinished engine-core requests that the core has (not held here)."""
        held = sum(len(reqs) for reqs in self._held.values())
        return self.output_processor.get_num_unfinished_requests() - held

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while True:
                if not self._has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if self._core_failure is not None:
                    # Found outside a step (an idle engine's health check, a send).
                    failure, self._core_failure = self._core_failure, None
                    await self._replace_core(failure)
                    continue
                now = time.monotonic()
                want_stats = now - self._last_stats >= STATS_INTERVAL_S
                if want_stats:
                    self._last_stats = now
                self._step_started = now
                try:
                    core_outputs, stats = await loop.run_in_executor(self._thread, self._step_core, want_stats)
                except EngineDeadError as failure:
                    self._step_started = None
                    await self._replace_core(failure)
                    continue
                self._step_started = None
                self.restarts.step_done()
                self._process(core_outputs)
                assert self._stepped is not None
                self._stepped.set()
                if stats is not None:
                    self.metrics.record_scheduler_stats(stats)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - every waiter must hear of it
            self.dead_error = e
            dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine loop failed: {e!r}")
            for queue in self._queues.values():
                queue.put_nowait(dead)

    async def _watch_steps(self) -> None:
        """End the engine when a step runs past `step_timeout_s` (a hang):
        the thread in `step` then sees the engine die and the loop replaces
        it. Looks a few times per timeout, off the per-step path."""
        ended_step: float | None = None
        while True:
            await asyncio.sleep(self.step_timeout_s / 4)
            started = self._step_started
            if started is not None and started != ended_step and time.monotonic() - started > self.step_timeout_s:
                ended_step = started
                logger.warning("an engine step has run for over %.0f s; ending the engine", self.step_timeout_s)
                self.engine_core.kill()

    async def _replace_core(self, failure: EngineDeadError) -> None:
        """Fail the requests `failure` blames, then a new core with every
        other unfinished request resumed on it (`RestartPolicy`). Requests
        admitted and aborted meanwhile wait in the client and go to the
        new core after those."""
        for request_id in self.restarts.begin(failure):
            self._started.discard(request_id)
            self._prefilled(request_id)
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(RequestFailedError(f"request {request_id} failed: {failure}"))
        await asyncio.get_running_loop().run_in_executor(self._thread, self.restarts.replace, failure)
        # A failure found meanwhile (a health check) was this one.
        self._core_failure = None
        self.metrics.record_restart()

    def _core_failed(self, failure: EngineDeadError) -> None:
        """The core was found dead outside a step: the loop replaces it."""
        if self._core_failure is None and self.restarts.restarting_since is None:
            self._core_failure = failure
            self._wake()

    def _step_core(self, want_stats: bool) -> tuple[list[EngineCoreOutput], SchedulerStats | None]:
        core = self.engine_core
        outputs = core.step()
        return outputs, core.make_stats() if want_stats else None

    def _process(self, core_outputs: list[EngineCoreOutput]) -> None:
        result = self.output_processor.process_outputs(core_outputs)
        if result.reqs_to_abort:
            self._abort_in_core(result.reqs_to_abort)
        prompt_tokens = generation_tokens = 0
        for out in result.request_outputs:
            if isinstance(out, RequestOutput):
                generation_tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.request_id not in self._started:
                self._started.add(out.request_id)
                prompt_tokens += len(out.prompt_token_ids)
                self._prefilled(out.request_id)
            self._deliver(out, notify=True)
        self.metrics.record_tokens(prompt_tokens, generation_tokens)

    def _prefilled(self, request_id: str) -> None:
        """The request's prompt leaves the admission count (its first output
        came, or it ended before one)."""
        reqs = self._unprefilled.pop(request_id, [])
        self._unprefilled_tokens -= sum(len(r.prompt_token_ids) for r in reqs)
        self._prefix_keys.pop(request_id, None)

    def _deliver(self, out: EngineOutput, notify: bool) -> None:
        if out.finished:
            self._started.discard(out.request_id)
            self._prefilled(out.request_id)
            if isinstance(out, RequestOutput):
                self.metrics.record_finished(out)
            else:
                self.metrics.record_pooled(out)
        queue = self._queues.get(out.request_id)
        if notify and queue is not None:
            queue.put_nowait(out)

    # ---- the control plane (docs/RL.md; `LLMEngine` documents each call) ----------

    async def _utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A core utility, waited for on a thread (the core runs it between steps)."""
        if self.dead_error is not None or self._closed:
            raise EngineDeadError("the engine is not running")
        return await asyncio.to_thread(self.engine_core.call_utility, method, *args, **kwargs)

    async def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return await self._utility("collective_rpc", method, args, kwargs)

    async def reset_prefix_cache(self) -> bool:
        return await self._utility("reset_prefix_cache")

    async def init_weight_transfer_engine(self, backend: str, **init_info: Any) -> None:
        await self._utility("init_weight_transfer_engine", backend, **init_info)

    async def start_weight_update(self) -> None:
        await self._utility("start_weight_update")

    async def update_weights(
        self, update_info: WeightUpdateInfo | dict[str, Any] | None = None, weights: Any = None
    ) -> None:
        shared = await asyncio.to_thread(self.engine_core.share_weights, weights)
        await self._utility("update_weights", update_info, shared)

    async def finish_weight_update(self) -> None:
        await self._utility("finish_weight_update")

    async def sync_weights(self, weights: Any, backend: str = "ray") -> None:
        await asyncio.to_thread(sync_weights, self.engine_core, weights, backend)

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """Stop generating; requests that arrive from now on are admitted
        and wait until `resume_generation`. `mode`: "abort" ends the
        requests in flight with their tokens so far (finish_reason
        "abort"); "wait" lets them finish first; "keep" freezes them where
        they are, to go on after the resume (with `clear_cache`, their KV is
        dropped and recomputed then: under new weights, after an update).
        `clear_cache` also forgets the prefix cache."""
        if mode not in PAUSE_MODES:
            raise InvalidParameterError("mode", f"must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._ensure_running()
        self._paused = True
        if mode == "abort":
            for request_id in [rid for rid in self._queues if rid not in self._held]:
                self._abort_now(request_id, notify=True)
        elif mode == "wait":
            assert self._stepped is not None
            while self._num_in_core() > 0:
                self._stepped.clear()
                await self._stepped.wait()
        else:
            self._frozen = True
            await self._utility("pause_scheduling", clear_cache)
        if clear_cache and mode != "keep":
            await self._utility("reset_prefix_cache")

    async def resume_generation(self) -> None:
        """Go on: frozen requests continue, held ones reach the engine in arrival order."""
        if self._frozen:
            await self._utility("resume_scheduling")
            self._frozen = False
        self._paused = False
        held, self._held = self._held, {}
        for core_reqs in held.values():
            self.engine_core.add_requests(core_reqs)
        self._wake()

    def is_paused(self) -> bool:
        return self._paused

    async def sleep(self, level: int = 1) -> None:
        """`LLMEngine.sleep`; requests made meanwhile wait for `wake_up`."""
        # First: a step awaited from an asleep core would never come.
        self._asleep = True
        try:
            await self._utility("sleep", level)
        except BaseException:
            self._asleep = await self._utility("is_sleeping")
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._asleep = await self._utility("wake_up", tags)
        self._wake()

    def is_sleeping(self) -> bool:
        return self._asleep

    # ---- health and lifecycle -----------------------------------------------------

    async def check_health(self, allow_restarting: bool = False) -> None:
        """Raise `EngineDeadError` unless the loop is alive and not stalled
        in a step, and every worker answers. `allow_restarting`: a core being
        replaced after a failure passes (the restart policy ends the engine
        if the replacement fails for good)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead_error!r}")
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self._loop_task is not None and self._loop_task.done():
            raise EngineDeadError("the engine loop exited")
        if self.restarts.restarting_since is not None:
            # Its requests wait for the new core (which may wait for resources).
            if allow_restarting:
                return
            raise EngineDeadError("the engine is restarting after a failure")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.step_timeout_s:
            raise EngineDeadError(f"an engine step has run for over {self.step_timeout_s:.0f} s")
        # A check that outlives its core (the loop replaced it meanwhile) says
        # nothing about the new one and must not make the loop replace it.
        core_generation = self.restarts.total
        try:
            await asyncio.to_thread(self.engine_core.check_health)
        except Exception as e:  # noqa: BLE001 - a dead actor surfaces as many Ray error types
            if self.restarts.total != core_generation:
                return await self.check_health(allow_restarting)
            failure = e if isinstance(e, EngineDeadError) else EngineDeadError(f"a worker failed its health check: {e!r}")
            if self._step_started is None:
                self._core_failed(failure)  # idle: nothing else would notice
            raise failure from e

    async def refresh_stats(self) -> None:
        """Fresh gauges (running, waiting, KV usage) for a scrape, even while
        idle; queued on the step thread, so it never runs inside a step."""
        if self.dead_error is not None or self._closed:
            return
        stats = await asyncio.get_running_loop().run_in_executor(self._thread, self.engine_core.make_stats)
        self.metrics.record_scheduler_stats(stats)

    def num_pending_requests(self) -> int:
        return len(self._queues)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.restarts.close()
        for task in (self._loop_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        # The step thread may be inside the core; shut the core down after it.
        self._thread.submit(self.engine_core.shutdown).result()
        self._thread.shutdown(wait=True)

    # ---- what the serving layer asks (its EngineClient protocol) -----------------------

    @property
    def model_path(self) -> str:
        return self.model_config.model

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    def check_runner(self, params: SamplingParams | PoolingParams) -> None:
        self.processor.check_runner(params)

    def check_lora(self, lora_request: LoRARequest) -> None:
        self.processor.lora.check(lora_request)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.tokenize(text, add_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        return self.processor.render_chat(messages, **options)

    def load(self) -> ReplicaLoad:
        """This engine's load as of the core's latest push, and the prompt
        tokens admitted and not yet prefilled that its prefix cache does not
        hold (as of the core's latest block events): what routing and
        autoscaling across replicas weigh it by. A replica full of
        follow-ups that hit is not busy."""
        stats = self.engine_core.latest_stats
        cached = self.engine_core.cached_block_keys
        block_size = self.config.cache_config.block_size
        queued = 0
        for request_id, reqs in self._unprefilled.items():
            keys = self._prefix_keys.get(request_id)
            if keys is None:
                keys = self._prefix_keys[request_id] = [
                    prefix_routing_keys(block_size, r.prompt_token_ids, request_extra_keys(
                        r.cache_salt, r.lora_request.lora_int_id if r.lora_request else None))
                    for r in reqs
                ]
            queued += sum(len(r.prompt_token_ids) - cached_prefix_tokens(block_size, k, cached)
                          for r, k in zip(reqs, keys))
        return ReplicaLoad(
            num_running=stats.num_running_reqs if stats is not None else 0,
            num_waiting=stats.num_waiting_reqs if stats is not None else 0,
            num_queued_tokens=queued,
            kv_usage=stats.kv_cache_usage if stats is not None else 0.0,
        )

    def routing_report(self) -> dict[str, Any]:
        """What a request router across replicas weighs this engine by
        (`encode_report`): its `load()` and the routing keys of the blocks
        its core caches."""
        return encode_report(self.load(), self.engine_core.cached_block_keys)

    async def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus text of fresh metrics, and its Content-Type."""
        await self.refresh_stats()
        return self.metrics.render()


def _resume_at(
    core_reqs: list[EngineCoreRequest], resume: ResumePoint, output_kind: RequestOutputKind, max_model_len: int
) -> None:
    """Give the one engine-core request the output its stream already has."""
    if len(core_reqs) != 1 or output_kind is not RequestOutputKind.DELTA:
        raise InvalidParameterError("resume", "only a streamed (DELTA) request with n=1 resumes")
    (req,) = core_reqs
    produced = len(resume.output_token_ids)
    assert req.sampling_params.max_tokens is not None
    if produced >= req.sampling_params.max_tokens or len(req.prompt_token_ids) + produced >= max_model_len:
        raise InvalidParameterError("resume", f"{produced} tokens already reach the request's length limit")
    req.output_token_ids = list(resume.output_token_ids)
