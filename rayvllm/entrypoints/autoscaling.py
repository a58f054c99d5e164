"""`EngineAutoscalingPolicy`: Serve's custom-autoscaling-policy extension
point over the Ray-free decision in core/autoscale.py.

Each LLMServer replica reports its engine's load through Serve's
`record_autoscaling_stats` hook (the `LOAD_METRICS` below); Serve averages
each over `look_back_period_s`, calls the policy every control-loop tick,
and applies min/max replicas, the scaling factors and the up/down delays
to what it returns. A replica chosen to go stops taking requests and gets
`drain_timeout_s` to finish the ones it has (Serve's graceful shutdown).

`autoscaling_config` (a `serve run` option, or the deployment's in
serve_config.yaml) takes Serve's keys plus this policy's targets,
`target_queued_prompt_tokens` and `target_kv_usage`;
`target_ongoing_requests` is Serve's key, read here too.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ray.serve.config import AutoscalingContext, AutoscalingPolicy

from rayvllm.core.autoscale import ScalingTargets, desired_replicas
from rayvllm.core.replica_router import ReplicaLoad
from rayvllm.messages.errors import InvalidParameterError

# The replica's metrics, named as `ReplicaLoad`'s fields.
LOAD_METRICS = tuple(f.name for f in fields(ReplicaLoad))
# autoscaling_config keys of this policy -> ScalingTargets fields.
TARGET_KEYS = {
    "target_queued_prompt_tokens": "queued_prompt_tokens",
    "target_ongoing_requests": "ongoing_requests",
    "target_kv_usage": "kv_usage",
}
# Serve's (deprecated) knob for how often replicas report, which Serve now
# reads from this variable in each replica's environment.
METRICS_INTERVAL_KEY = "metrics_interval_s"
METRICS_PUSH_ENV = "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"


class EngineAutoscalingPolicy:
    """Called by Serve's controller with each tick's `AutoscalingContext`."""

    def __init__(self, **targets: Any) -> None:
        self.targets = ScalingTargets(**targets)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        replicas = set().union(*(metrics.get(name, {}) for name in LOAD_METRICS))
        # Averages over the look-back window: counts may be fractional.
        loads = [ReplicaLoad(**{name: metrics.get(name, {}).get(r, 0) for name in LOAD_METRICS}) for r in replicas]
        return desired_replicas(loads, ctx.current_num_replicas, self.targets), {}


def serve_autoscaling_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A user's `autoscaling_config` as Serve takes it, with this policy
    (unless it names its own) holding the targets; and the replica
    environment that makes replicas report every `metrics_interval_s`."""
    serve_config = {k: v for k, v in config.items() if k not in TARGET_KEYS or k == "target_ongoing_requests"}
    env: dict[str, str] = {}
    if METRICS_INTERVAL_KEY in config:
        env[METRICS_PUSH_ENV] = str(config[METRICS_INTERVAL_KEY])
    if "policy" not in config:
        targets = {field: config[key] for key, field in TARGET_KEYS.items() if key in config}
        try:
            ScalingTargets(**targets)  # a bad target fails the deploy, not the controller's loop
        except (TypeError, ValueError) as e:
            raise InvalidParameterError("autoscaling_config", str(e)) from None
        serve_config["policy"] = AutoscalingPolicy(policy_function=EngineAutoscalingPolicy, policy_kwargs=targets)
    return serve_config, env
