"""Autoscaling on the engines' own signals: the Ray-free decision, the
Serve policy over the replicas' reported metrics, the `autoscaling_config`
option as Serve takes it, and a deployment that a ramp of load scales from
one replica to two and its end back to one, every text exact and nothing
left behind."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rayvllm.core.autoscale import ScalingTargets, desired_replicas
from rayvllm.core.replica_router import ReplicaLoad
from rayvllm.messages.errors import InvalidParameterError

TARGETS = ScalingTargets(queued_prompt_tokens=1000, ongoing_requests=10, kv_usage=0.5)


def test_the_most_demanding_signal_sets_the_count() -> None:
    idle = ReplicaLoad()
    assert desired_replicas([idle, idle], 2, TARGETS) == 0.0  # Serve's min_replicas bounds it
    assert desired_replicas([], 3, TARGETS) == 3.0  # nothing reported yet: no decision
    prefill = ReplicaLoad(num_running=2, num_queued_tokens=2500)
    assert desired_replicas([prefill], 1, TARGETS) == 2.5  # a queue of long prompts, few requests
    chats = ReplicaLoad(num_running=8, num_waiting=22, num_queued_tokens=300)
    assert desired_replicas([chats], 1, TARGETS) == 3.0  # many short requests
    full = ReplicaLoad(num_running=1, kv_usage=0.9)
    assert desired_replicas([full, ReplicaLoad(kv_usage=0.6)], 2, TARGETS) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        ScalingTargets(kv_usage=1.5)


ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from rayvllm.entrypoints.autoscaling import (  # noqa: E402
    METRICS_PUSH_ENV,
    EngineAutoscalingPolicy,
    serve_autoscaling_config,
)
from rayvllm.entrypoints.serve_builder import build_app  # noqa: E402


def test_the_policy_reads_what_the_replicas_reported() -> None:
    policy = EngineAutoscalingPolicy(queued_prompt_tokens=100, ongoing_requests=10, kv_usage=0.5)
    metrics = {"num_queued_tokens": {"r1": 150.0, "r2": 100.0}, "num_running": {"r1": 2.0}, "kv_usage": {"r2": 0.1}}
    ctx = SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=2)
    assert policy(ctx) == (2.5, {})  # type: ignore[arg-type]
    assert policy(SimpleNamespace(aggregated_metrics={}, current_num_replicas=1)) == (1.0, {})  # type: ignore[arg-type]


def test_autoscaling_config_becomes_serves_with_the_engine_policy() -> None:
    config, env = serve_autoscaling_config({
        "min_replicas": 1, "max_replicas": 4, "target_queued_prompt_tokens": 512, "target_ongoing_requests": 8,
        "metrics_interval_s": 0.5,
    })
    policy = config.pop("policy")
    assert config == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8, "metrics_interval_s": 0.5}
    assert policy.policy_kwargs == {"queued_prompt_tokens": 512, "ongoing_requests": 8}
    assert env == {METRICS_PUSH_ENV: "0.5"}
    with pytest.raises(InvalidParameterError) as info:
        serve_autoscaling_config({"max_replicas": 2, "target_kv_usage": 2.0})
    assert info.value.param == "autoscaling_config"
    with pytest.raises(InvalidParameterError) as info:
        build_app({"num_replicas": "2", "autoscaling_config": '{"max_replicas": 2}'})
    assert "exclude each other" in str(info.value)
    deployment = build_app({"autoscaling_config": '{"min_replicas": 1, "max_replicas": 3}'})._bound_deployment  # type: ignore[attr-defined]
    assert deployment.name == "OpenAIRouter"  # more than one replica possible: the router ingress in front


APP = "autoscale-test"
DEADLINE_S = 180.0
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _wait_for(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)  # polling the cluster's state, which changes on its own


def _servers() -> int:
    return serve.status().applications[APP].deployments["LLMServer"].replica_states.get("RUNNING", 0)


def _groups() -> set[str]:
    return {pg for pg, info in placement_group_table().items() if info["state"] != "REMOVED"}


@pytest.fixture()
def autoscaled(serve_local: str, tiny_model_dir: Path) -> Iterator[tuple[Any, set[str]]]:
    """One to two replicas scaled on queued prompt tokens alone (the other
    targets out of reach), reporting every quarter second; the groups alive
    before it. Deletes the app after."""
    before = _groups()
    config = {
        "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0, "downscale_delay_s": 1,
        "look_back_period_s": 1, "metrics_interval_s": 0.25,
        "target_queued_prompt_tokens": 64, "target_ongoing_requests": 1000, "target_kv_usage": 1.0,
    }
    args = dict(model=str(tiny_model_dir), max_num_seqs=2, max_model_len=256, kv_cache_memory_bytes=8 << 20,
                autoscaling_config=config)
    try:
        yield serve.run(build_app(args), name=APP, route_prefix=None), before
    finally:
        serve.delete(APP)


def test_a_ramp_of_load_scales_up_and_its_end_scales_back(
    autoscaled: tuple[Any, set[str]], tiny_model_dir: Path
) -> None:
    from rayvllm import LLM, SamplingParams

    handle, before = autoscaled
    prompts = [f"request {i} " + "word " * (40 + i) for i in range(8)]
    llm = LLM(model=str(tiny_model_dir), max_model_len=256, kv_cache_memory_bytes=8 << 20)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**GREEDY))]
    llm.shutdown()
    served: list[str] = []

    def load() -> None:
        """Eight ~50-token prompts at once on two sequence slots: a queue of
        prompt tokens far over the target."""
        outs = [handle.generate.remote(p, GREEDY) for p in prompts]
        served.extend(o.result().outputs[0].text for o in outs)

    assert _servers() == 1
    # Load without pause until Serve adds the replica: the policy averages
    # queued tokens over its look-back window, which gaps between rounds
    # of load would dilute.
    stop = threading.Event()

    def keep_loading() -> None:
        while not stop.is_set():
            load()

    loader = threading.Thread(target=keep_loading, name="load", daemon=True)
    loader.start()
    try:
        _wait_for("a second replica under load", lambda: _servers() == 2)
    finally:
        stop.set()
        loader.join()
    load()  # both replicas serve
    _wait_for("the idle deployment to scale back to one replica", lambda: _servers() == 1)
    load()
    assert served and all(text == expected[i % 8] for i, text in enumerate(served))
    serve.delete(APP)
    _wait_for("every placement group of the app to go", lambda: _groups() <= before)
