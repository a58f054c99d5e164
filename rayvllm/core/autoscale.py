"""How many replicas a deployment's load asks for, read from the engines'
own signals rather than request counts alone.

A request count is blind to what a request costs: eight requests with
8k-token prompts queue a minute of prefill where eight short chats queue
none. So each replica reports its engine's load (`ReplicaLoad`: requests
running and waiting, prompt tokens admitted but not yet prefilled, the
fraction of its KV blocks in use), and the deployment wants as many
replicas as the most demanding of three targets asks for:

- queued prompt tokens, summed, over `target_queued_prompt_tokens` per replica;
- requests, summed, over `target_ongoing_requests` per replica (Serve's own signal);
- mean KV usage over `target_kv_usage`, times the replicas reporting.

The result is a float; Serve's wrapper applies min/max replicas, the
scaling factors and the up/down delays. Ray-free: the Serve policy
(entrypoints/autoscaling.py) feeds it the replicas' reported metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayvllm.core.replica_router import ReplicaLoad

__all__ = ["ScalingTargets", "desired_replicas"]


@dataclass(frozen=True, slots=True)
class ScalingTargets:
    """Per-replica load a deployment is scaled to keep (see the module doc)."""

    queued_prompt_tokens: int = 4096
    ongoing_requests: float = 64.0
    kv_usage: float = 0.8

    def __post_init__(self) -> None:
        if self.queued_prompt_tokens <= 0 or self.ongoing_requests <= 0 or not 0.0 < self.kv_usage <= 1.0:
            raise ValueError(f"scaling targets must be positive (kv_usage in (0, 1]): {self}")


def desired_replicas(loads: Sequence[ReplicaLoad], current: int, targets: ScalingTargets) -> float:
    """Replicas the reported `loads` ask for. `current` when no replica has
    reported yet (a decision needs a signal; none is not idleness)."""
    if not loads:
        return float(current)
    queued = sum(load.num_queued_tokens for load in loads) / targets.queued_prompt_tokens
    requests = sum(load.num_running + load.num_waiting for load in loads) / targets.ongoing_requests
    kv = sum(load.kv_usage for load in loads) / targets.kv_usage
    return max(queued, requests, kv)
