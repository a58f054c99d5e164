"""When the engine loop should send its next step call under async scheduling.

With async scheduling the SchedulerActor queues step k+1 on the worker while
step k runs, so the worker never waits for the scheduler. Scheduled at the
start of step k, though, step k+1 is fixed a whole step before it runs: a
request that arrives during step k misses it and waits for k+2, one step of
TTFT that synchronous scheduling does not pay.

The pacer removes most of that step. After a step call returns, the loop
waits until shortly before the worker is expected to finish the step it is
running, then sends the next call with every request that arrived meanwhile.
"Shortly" is the lead: the time the call needs to reach the worker as a
scheduled step (channel, scheduling, pickling). The lead adapts: when the
worker reports that it sat idle before a paced step (the call came too late),
the lead grows by that idle time; otherwise it shrinks slowly towards
`MIN_LEAD_S`. The step-time estimate comes from the worker's own busy time of
decode-only steps, never from the spacing of replies, which would include the
idle time a late call causes and feed back into later calls.

Invariant: `delay` never exceeds the estimated time left in the running step,
so pacing only moves a call within a step the worker is busy with; a wrong
estimate costs at most that much worker idle time, once, before the lead grows.
"""

from __future__ import annotations

from rayvllm.worker.outputs import ModelRunnerOutput

# A paced step that found the worker idle for longer than this was late.
LATE_S = 0.0005
MIN_LEAD_S = 0.001
INITIAL_LEAD_S = 0.003
# Per on-time paced step; a late one raises the lead at once.
LEAD_DECAY = 0.97
BUSY_EMA_ALPHA = 0.25


class StepPacer:
    """One per DP rank. Times are in seconds, measured by the caller's
    monotonic clock (`elapsed_s`) and by the worker (`busy_s`, `idle_s`)."""

    def __init__(self) -> None:
        self.lead_s = INITIAL_LEAD_S
        self.busy_s: float | None = None  # EMA of decode-only step busy time

    def observe(self, output: ModelRunnerOutput, decode_only: bool, paced: bool) -> None:
        """Account one finished step: `paced` when its call was held back by
        `delay`, `decode_only` when every request in it computed one token."""
        if output.busy_s <= 0.0:
            return  # an executor that does not time its steps: never pace
        if decode_only:
            prev = self.busy_s
            self.busy_s = output.busy_s if prev is None else prev + BUSY_EMA_ALPHA * (output.busy_s - prev)
        if paced and self.busy_s is not None:  # a paced call had an estimate
            if output.idle_s > LATE_S:
                # Capped at a whole step: beyond it pacing holds nothing back.
                self.lead_s = min(self.lead_s + output.idle_s, self.busy_s)
            else:
                self.lead_s = max(MIN_LEAD_S, self.lead_s * LEAD_DECAY)

    def delay(self, elapsed_s: float) -> float:
        """Seconds to hold the next call, given that the worker started its
        current step `elapsed_s` ago; 0 without an estimate yet."""
        if self.busy_s is None:
            return 0.0
        return max(0.0, self.busy_s - elapsed_s - self.lead_s)
