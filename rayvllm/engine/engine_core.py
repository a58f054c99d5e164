"""The engine core: schedulers + executors, one `step()` per model forward.

One `Scheduler` (with its own KV block pool and prefix cache) and one
`Executor` (a worker group) per data-parallel rank; new requests are routed
to a rank by exact prefix hit, then load. With pipeline parallelism up to
`pipeline_parallel_size` scheduled steps per rank are in flight at once, so
the stages work on different steps at the same time.

With async scheduling, step k+1 is normally scheduled and queued on the
workers while step k runs, so the workers never wait for the scheduler; but
then a request that arrives during step k misses k+1 and waits a whole step
more. When requests can arrive while a step runs (an intake, on the
SchedulerActor) and the batch has room for them, the core schedules just in
time instead: it waits for step k, takes the intake, and only then schedules
k+1, leaving the workers idle for the scheduling alone. A saturated engine
(requests waiting, or a full batch) keeps the queued step: a new arrival
would wait anyway.

Data-parallel ranks never wait on each other: each call takes back the
steps that have finished, on whichever ranks, and schedules those ranks'
next steps; it waits only while no rank has a finished step. Nor do they
die together: when a rank's worker group dies, its requests move to a fresh
scheduler of that rank (recomputed from prompt plus emitted tokens, as after
a preemption), its group is rebuilt on a thread (rank_recovery.py), and the
other ranks step on meanwhile; a new group that fails as it starts is tried
again (restart_policy.RestartLimits), and only a rebuild that keeps failing
ends the core.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from rayvllm.config import EngineConfig
from rayvllm.core.dp_router import DPRouter, RankLoad
from rayvllm.core.block_events import BlockEventLog, ListenerFanout
from rayvllm.core.prefix_index import PrefixIndex
from rayvllm.core.request import Request
from rayvllm.core.sched.scheduler import Scheduler
from rayvllm.engine.intake import RequestIntake
from rayvllm.engine.rank_recovery import RankRecovery
from rayvllm.engine.restart_policy import RestartLimits
from rayvllm.executor.base import Executor, ExecutorFactory, PendingOutput
from rayvllm.kv_offload.factory import create_kv_tier
from rayvllm.lora.slots import LoRASlots
from rayvllm.messages.engine_types import BlockEvents, EngineCoreOutput, ModelRunnerOutput, SchedulerStats
from rayvllm.messages.errors import EngineDeadError, InvalidParameterError, StepFailedError
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.messages.weight_update import WeightUpdateInfo
from rayvllm.models.honoured import kv_window, layer_windows
from rayvllm.spec_decode.eligibility import can_speculate

logger = logging.getLogger(__name__)

# The methods a client may call between steps (`call_utility`).
UTILITY_METHODS = frozenset({
    "collective_rpc", "reset_prefix_cache", "init_weight_transfer_engine", "start_weight_update",
    "update_weights", "finish_weight_update", "pause_scheduling", "resume_scheduling", "sleep", "wake_up",
    "is_sleeping",
})
# Utilities that wait on someone outside the engine (a weight-transfer group
# forms only when the trainer and every worker joined): the loop runs them
# beside its steps (core_loop.py), so requests are served meanwhile. They
# touch no state a step reads.
BACKGROUND_UTILITIES = frozenset({"init_weight_transfer_engine"})
# Utilities that never reach the workers: they may run while a background
# one holds them.
CORE_ONLY_UTILITIES = frozenset({"reset_prefix_cache", "pause_scheduling", "resume_scheduling", "is_sleeping"})
SLEEP_TAGS = ("weights", "kv_cache")


def released_kv_window(config: EngineConfig) -> int | None:
    """The window behind which the schedulers release each request's KV
    blocks (CacheConfig.sliding_window): the model's, where every layer
    has one (`kv_window`). None with a draft model, which shares the
    target's blocks and catches up from a request's start
    (spec_decode/draft_proposer.py), writing the positions a window left
    behind."""
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        return None
    return kv_window(layer_windows(config.model_config.hf_config))


@dataclass
class _InflightStep:
    scheduler_output: SchedulerOutput
    pending: PendingOutput


class EngineCore:
    """Token ids in, token ids out. Invariants: the scheduler's view of every
    request and its workers' are updated by the same `SchedulerOutput`, in
    the order they were scheduled; a request stays on the DP rank it was
    routed to until it finishes."""

    # Not thread-safe: adds and aborts must come from the thread that steps
    # (its loop, core_loop.py, takes them from an intake).
    def __init__(self, config: EngineConfig, executor_factory: ExecutorFactory) -> None:
        """`executor_factory`: a new worker group for a DP rank (local or
        on Ray: the caller decides), for each rank at the start and to
        rebuild a rank whose group died."""
        self.config = config
        self.executor_factory = executor_factory
        # DP ranks whose worker group is being rebuilt, and ranks a health
        # check found dead (added from the health check's thread, taken by
        # the stepping one). Set first: a failed start shuts down.
        self.recoveries: dict[int, RankRecovery] = {}
        # The rule for starting a rank's group anew; a rebuilt group
        # installed starts a new row.
        self.rebuild_limits = RestartLimits()
        self._found_dead: set[int] = set()
        self.num_rank_rebuilds = 0
        self._wake_loop: Callable[[], None] | None = None
        pc = config.parallel_config
        dp = pc.data_parallel_size
        self.executors = [executor_factory(rank) for rank in range(dp)]
        try:
            num_blocks = min(executor.initialize() for executor in self.executors)
        except BaseException:
            self.shutdown()
            raise
        needed = -(-config.model_config.max_model_len // config.cache_config.block_size) + 1
        if num_blocks < needed:
            self.shutdown()
            raise ValueError(
                f"the KV cache holds {num_blocks - 1} blocks of {config.cache_config.block_size} tokens, "
                f"fewer than one max_model_len={config.model_config.max_model_len} sequence needs "
                f"({needed - 1}); raise the KV cache budget or lower max_model_len"
            )
        config.cache_config.num_blocks = num_blocks
        config.cache_config.sliding_window = released_kv_window(config)
        # Pipeline stages each hold a step; async scheduling keeps the next
        # step queued on the workers while the current one runs.
        self.max_inflight = max(pc.pipeline_parallel_size, 2 if config.scheduler_config.async_scheduling else 1)
        caching = config.cache_config.enable_prefix_caching
        self.prefix_index = PrefixIndex(dp) if caching and dp > 1 else None
        self.block_events = BlockEventLog(dp) if caching else None
        self.schedulers = [self._make_scheduler(rank) for rank in range(dp)]
        self.router = DPRouter(dp, config.cache_config.block_size, self.prefix_index)
        self.inflight: list[deque[_InflightStep]] = [deque() for _ in range(dp)]
        # Just in time applies to async scheduling's one queued step;
        # pipeline stages are kept full instead.
        self._can_wait_for_intake = self.max_inflight == 2 and pc.pipeline_parallel_size == 1
        self.request_rank: dict[str, int] = {}
        # No step is scheduled while paused (`pause_scheduling`) or asleep
        # (`sleep`: the KV cache is freed); requests wait where they are.
        self.paused = False
        self.asleep = False

    def _make_scheduler(self, rank: int) -> Scheduler:
        pc = self.config.parallel_config
        index = self.prefix_index
        listeners = [x.listener(rank) for x in (index, self.block_events) if x is not None]
        return Scheduler(
            self.config.scheduler_config,
            self.config.cache_config,
            # Under async scheduling TP rank 0 hands them to its group instead.
            send_token_ids=pc.world_size > 1 and not self.config.scheduler_config.async_scheduling,
            max_inflight_steps=self.max_inflight,
            listener=ListenerFanout(*listeners) if len(listeners) > 1 else (listeners[0] if listeners else None),
            kv_tier=create_kv_tier(self.config, index.tier_listener(rank) if index is not None else None),
            speculative_config=self.config.speculative_config,
            can_speculate=can_speculate if self.config.speculative_config is not None else None,
            lora_slots=LoRASlots(self.config.lora_config.max_loras) if self.config.lora_config is not None else None,
        )

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of DP rank 0 (the only one without data parallelism)."""
        return self.schedulers[0]

    @property
    def executor(self) -> Executor:
        return self.executors[0]

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Add requests that share one prompt (the children of an n > 1
        request) to one DP rank, so they can share its cached blocks."""
        reqs = [Request(r) for r in requests]
        rank = 0
        if len(self.schedulers) > 1 and reqs:
            loads = [
                RankLoad.from_requests(s.waiting, s.running, s.kv_cache_manager.usage) for s in self.schedulers
            ]
            if len(self.recoveries) < len(self.schedulers):
                # A rank being rebuilt takes nothing new while another serves.
                for rank in self.recoveries:
                    loads[rank] = RankLoad(num_queued_tokens=1 << 62, kv_usage=1.0)
            rank = self.router.route(reqs[0], loads)
        for req in reqs:
            self.request_rank[req.request_id] = rank
            self.schedulers[rank].add_request(req)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        aborted: list[str] = []
        for req_id in request_ids:
            rank = self.request_rank.pop(req_id, None)
            if rank is not None:
                aborted += self.schedulers[rank].abort_requests([req_id])
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_rank)

    def has_work(self) -> bool:
        """Requests to run on a rank that can run them, or steps still on
        the workers. (A rank being rebuilt wakes its loop when it is back.)"""
        if any(self.inflight):
            return True
        if self.paused or self.asleep:
            return False
        if not self.recoveries:
            return bool(self.request_rank)
        return any(rank not in self.recoveries for rank in self.request_rank.values())

    def step(self, intake: RequestIntake | None = None) -> list[EngineCoreOutput]:
        """Take back the finished oldest step of each rank (at least one,
        waiting if none is) and return their outputs, with every rank's next
        step already on its workers. `intake` holds
        requests that arrived since the last call (see the module docstring
        for when it is taken before and when after the running step ends)."""
        if intake is not None:
            self._wake_loop = intake.wake
        self._tend_recoveries(block=intake is None)
        if intake is not None and self._can_wait_for_intake and self._has_room():
            finished = self._just_in_time(intake)
            if not finished and any(self.inflight):
                # The engine was idle: take back the step just scheduled in
                # this call, not in another round trip from the engine loop.
                finished = self._just_in_time(intake)
        else:
            if intake is not None:
                intake.drain_into(self)
            self._schedule(self.max_inflight)
            finished = self._take_finished()
        return self._update(finished)

    def _update(self, finished: list[tuple[int, _InflightStep, ModelRunnerOutput]]) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for rank, step, result in finished:
            outputs += self.schedulers[rank].update_from_output(step.scheduler_output, result)
        for out in outputs:
            if out.finish_reason is not None:
                self.request_rank.pop(out.request_id, None)
        return outputs

    def has_inflight(self) -> bool:
        return any(self.inflight)

    def finish_inflight(self) -> list[EngineCoreOutput]:
        """Take back every step on the workers and schedule none: the
        workers are idle after it (the loop runs a utility call then)."""
        outputs: list[EngineCoreOutput] = []
        while any(self.inflight):
            outputs += self._update(self._take_finished())
        return outputs

    def _just_in_time(self, intake: RequestIntake) -> list[tuple[int, _InflightStep, ModelRunnerOutput]]:
        """Wait for the running steps, then take the intake and schedule."""
        finished = self._take_finished()
        intake.drain_into(self)
        self._schedule(1)
        return finished

    def _has_room(self) -> bool:
        """No rank has requests waiting or a full batch."""
        return all(not s.waiting and len(s.running) < s.max_num_seqs for s in self.schedulers)

    def _schedule(self, depth: int) -> None:
        """Schedule and submit steps until each rank has `depth` in flight
        or nothing left to run (nothing while paused or asleep)."""
        if self.paused or self.asleep:
            return
        for rank, scheduler in enumerate(self.schedulers):
            if rank in self.recoveries:
                continue
            queue = self.inflight[rank]
            while len(queue) < depth:
                so = scheduler.schedule()
                if so.is_empty and not so.finished_req_ids:
                    break
                queue.append(_InflightStep(so, self.executors[rank].execute_model_async(so)))
                if so.is_empty:
                    break

    def _take_finished(self) -> list[tuple[int, _InflightStep, ModelRunnerOutput]]:
        """Take back each rank's oldest step that has finished, waiting only
        until at least one has: a rank whose step runs long (a big prefill)
        never holds up another rank's tokens. With one rank busy this is a
        plain wait for its step."""
        busy = [rank for rank, queue in enumerate(self.inflight) if queue]
        if len(busy) > 1:
            while not any(self.inflight[rank][0].pending.done() for rank in busy):
                wait([h for rank in busy for h in self.inflight[rank][0].pending.wait_handles()])
            busy = [rank for rank in busy if self.inflight[rank][0].pending.done()]
        taken = []
        for rank in busy:
            step = self.inflight[rank].popleft()
            try:
                result = step.pending.result()
            except EngineDeadError as e:
                if len(self.schedulers) == 1:
                    raise
                self._start_recovery(rank, e)
                continue
            except Exception as e:  # noqa: BLE001 - a worker raised and lives on
                so = step.scheduler_output
                culprits = [new.req_id for new in so.scheduled_new_reqs if not new.output_token_ids]
                raise StepFailedError(f"a step failed on DP rank {rank}: {e!r}", culprits) from e
            taken.append((rank, step, result))
        return taken

    # ---- the control plane (utility calls: the loop runs them with no step in flight) --

    def call_utility(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in UTILITY_METHODS:
            raise InvalidParameterError("method", f"{method!r} is not a utility of the engine core")
        return getattr(self, method)(*args, **kwargs)

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """`method` on every worker (`Worker.run_method`); the results by DP
        rank, then worker rank."""
        return self._on_all_ranks(lambda dp_rank, executor: executor.collective_rpc(method, args, kwargs))

    def _on_all_ranks(self, call: Callable[[int, Executor], list[Any]]) -> list[Any]:
        """`call` for every DP rank's group, at the same time: a weight
        transfer group forms only once every rank has joined."""
        if len(self.executors) == 1:
            return call(0, self.executors[0])
        with ThreadPoolExecutor(len(self.executors)) as pool:
            per_rank = list(pool.map(call, range(len(self.executors)), self.executors))
        return [result for results in per_rank for result in results]

    def reset_prefix_cache(self) -> bool:
        """Forget every rank's cached prefixes; False where a rank still has
        blocks owned by requests (nothing is dropped on that rank)."""
        return all([s.kv_cache_manager.reset_prefix_cache() for s in self.schedulers])

    def init_weight_transfer_engine(self, backend: str, rank_offset: int = 1, **init_info: Any) -> None:
        """Every worker takes rank `rank_offset` + its place among all the
        engine's workers (DP rank major) in the trainer's group."""
        world = self.config.parallel_config.world_size
        self._on_all_ranks(lambda dp_rank, executor: executor.collective_rpc(
            "init_weight_transfer_engine", (backend, rank_offset + dp_rank * world), init_info
        ))

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, update_info: WeightUpdateInfo | dict[str, Any] | None = None, weights: Any = None) -> None:
        info = WeightUpdateInfo(**update_info) if isinstance(update_info, dict) else update_info
        self.collective_rpc("update_weights", (info, weights))

    def finish_weight_update(self) -> None:
        """Rebuild every worker's model from the staged update, then forget
        the prefix cache (its blocks hold the old weights' KV)."""
        self.collective_rpc("finish_weight_update")
        self.reset_prefix_cache()

    def pause_scheduling(self, clear_cache: bool = False) -> None:
        """Freeze every request where it is (`pause_generation(mode="keep")`).
        `clear_cache`: preempt the running ones too, so their KV is
        recomputed when they go on (under the weights of that time), and
        forget the prefix cache."""
        self.paused = True
        if clear_cache:
            for scheduler in self.schedulers:
                scheduler.preempt_running()
            self.reset_prefix_cache()

    def resume_scheduling(self) -> None:
        self.paused = False

    def sleep(self, level: int = 1) -> None:
        """Free every worker's KV cache (level 1) and weights too (level 2;
        docs/RL.md). Running requests are preempted by recompute and the
        prefix cache forgotten first (the blocks' contents go); nothing is
        scheduled until the KV cache is awake again."""
        if level not in (1, 2):
            raise InvalidParameterError("level", f"must be 1 or 2, got {level!r}")
        # The workers first: one that refuses leaves the engine as it was.
        self.collective_rpc("sleep", (level,))
        self.asleep = True
        for scheduler in self.schedulers:
            scheduler.preempt_running()
        self.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back the `tags` ("weights", "kv_cache"; None: both; the KV
        cache needs the weights awake); returns whether still asleep."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
        if unknown:
            raise InvalidParameterError("tags", f"unknown {unknown}; the tags are {', '.join(SLEEP_TAGS)}")
        self.collective_rpc("wake_up", (tags,))
        if "kv_cache" in tags:
            self.asleep = False
        return self.asleep

    def is_sleeping(self) -> bool:
        return self.asleep

    def take_block_events(self) -> BlockEvents | None:
        """The block events since the previous call (each reported once:
        only the loop's push should take them)."""
        return self.block_events.drain() if self.block_events is not None else None

    def make_stats(self) -> SchedulerStats:
        stats = [s.make_stats() for s in self.schedulers]
        if len(stats) == 1:
            return stats[0]
        combined = SchedulerStats.combine(stats)
        combined.num_rank_rebuilds = self.num_rank_rebuilds
        return combined

    # ---- a DP rank's worker group dies --------------------------------------------

    def _start_recovery(self, rank: int, cause: BaseException) -> None:
        """Move the rank's requests to a fresh scheduler (its KV cache died
        with the workers) and rebuild its worker group on a thread."""
        logger.warning("DP rank %d lost its worker group (%s); rebuilding it", rank, cause)
        self.inflight[rank].clear()
        live = sorted(self.schedulers[rank].requests.values(), key=lambda r: r.arrival_time)
        if self.prefix_index is not None:
            self.prefix_index.clear_rank(rank)
        if self.block_events is not None:
            self.block_events.clear_rank(rank)
        preempted = self.schedulers[rank].num_preemptions
        scheduler = self.schedulers[rank] = self._make_scheduler(rank)
        scheduler.num_preemptions = preempted  # a cumulative count the metrics difference
        for request in live:
            scheduler.add_request(request.moved())
        self.recoveries[rank] = RankRecovery(
            rank, self.executors[rank], lambda: self.executor_factory(rank),
            self.config.cache_config.num_blocks, self._wake, self.rebuild_limits, cause,
        )

    def _tend_recoveries(self, block: bool) -> None:
        """Start recoveries for ranks a health check found dead; install the
        groups rebuilt since. `block`: with no other rank able to step,
        wait for a rebuild (the offline engine has no intake to wake it)."""
        if not self._found_dead and not self.recoveries:
            return  # the common case, on every step
        for rank in list(self._found_dead):
            self._found_dead.discard(rank)
            if rank not in self.recoveries:
                self._start_recovery(rank, EngineDeadError("a health check found it dead"))
        if block and self.recoveries and not self.has_work():
            next(iter(self.recoveries.values())).wait()
        for rank, recovery in list(self.recoveries.items()):
            if not recovery.done():
                continue
            del self.recoveries[rank]
            if recovery.executor is None:
                raise EngineDeadError(f"DP rank {rank} could not be rebuilt: {recovery.error!r}")
            self.executors[rank] = recovery.executor
            self.num_rank_rebuilds += 1
            self.rebuild_limits.step_done()

    def _wake(self) -> None:
        wake = self._wake_loop
        if wake is not None:
            wake()

    def check_health(self) -> None:
        """Raise if any worker of any DP rank is dead. With several DP ranks
        a dead one is rebuilt instead (the stepping thread is told), and
        ranks being rebuilt are not asked."""
        dp = len(self.executors)
        for rank, executor in enumerate(list(self.executors)):
            if rank in self.recoveries:
                continue
            try:
                executor.check_health()
            except Exception:
                if dp == 1:
                    raise
                self._found_dead.add(rank)
                self._wake()

    def shutdown(self) -> None:
        self.rebuild_limits.close()
        for recovery in self.recoveries.values():
            recovery.cancel()
        for executor in self.executors:
            executor.shutdown()
