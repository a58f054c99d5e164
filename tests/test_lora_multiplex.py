"""Two Serve replicas with adapters: Serve's model multiplexing sends every
request for an adapter to the replica that served it first (each replica
reports the adapters it serves), so that replica's prefix cache under the
adapter keeps hitting; the other replica never loads it."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402
from ray.serve._private.common import DeploymentID  # noqa: E402
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE  # noqa: E402

from rayvllm import SamplingParams  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.entrypoints.openai.api_server import LLMServer  # noqa: E402
from rayvllm.entrypoints.serve_builder import replica_placement  # noqa: E402

from hf_oracle import NUM_NEW  # noqa: E402
from lora_oracle import build_adapter, peft_greedy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(tiny_model_dir, tmp_path_factory.mktemp("mux") / "a", seed=31, rank=8)


@pytest.fixture(scope="module")
def two_replicas(
    serve_local: None, tiny_model_dir: Path, adapter: Path
) -> Iterator[serve.handle.DeploymentHandle]:
    """The handle's router runs in this process. Serve sends a request for
    an adapter to another replica when the one holding it has not taken the
    request within 1-2 s (its matching timeout), which a loaded 2-core
    machine can exceed; the test is about where requests go when that
    replica answers, so the window is widened here."""
    from ray.serve._private.request_router import request_router

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(request_router, "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S", 30.0)
        yield from _two_replicas(tiny_model_dir, adapter)


def _two_replicas(tiny_model_dir: Path, adapter: Path) -> Iterator[serve.handle.DeploymentHandle]:
    try:
        args = dict(model=str(tiny_model_dir), enable_lora=True, max_loras=1, max_lora_rank=16, max_num_seqs=4,
                    max_model_len=256, kv_cache_memory_bytes=8 << 20)
        app = LLMServer.options(num_replicas=2, **replica_placement(EngineArgs(**args))).bind(  # type: ignore[attr-defined]
            args, lora_modules=[f"a={adapter}"],
        )
        yield serve.run(app, name="mux", route_prefix=None)
    finally:
        serve.delete("mux")


def _replicas_serving(model_id: str) -> list[str]:
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    states = ray.get(controller._dump_replica_states_for_testing.remote(DeploymentID("LLMServer", "mux")))
    return [str(r.replica_id) for r in states.get() if model_id in r.multiplexed_model_ids]


def _router_serving(handle: serve.handle.DeploymentHandle, model_id: str) -> bool:
    """This process's router for `handle` knows a replica serving
    `model_id` (Ray 2.60's internals; the version is pinned)."""
    router = handle._router._asyncio_router.request_router  # type: ignore[union-attr]
    return router is not None and bool(router._multiplexed_model_id_to_replica_ids.get(model_id))


def test_requests_for_an_adapter_stay_on_its_replica(
    two_replicas: serve.handle.DeploymentHandle, tiny_model_dir: Path, adapter: Path
) -> None:
    handle = two_replicas.options(multiplexed_model_id="a")
    rng = random.Random(9)

    def prompt() -> list[int]:
        return [rng.randrange(5, 4000) for _ in range(40)]

    first = prompt()
    out = handle.generate.remote({"prompt_token_ids": first}, GREEDY).result()
    assert out.outputs[0].token_ids == peft_greedy(tiny_model_dir, adapter, first)
    # The replica's report reaches the controller, then this handle's
    # router; until the router has it, a request for "a" may go to either
    # replica (which then loads it too). Wait for both.
    deadline = time.monotonic() + 60
    while not (_replicas_serving("a") and _router_serving(handle, "a")):
        assert time.monotonic() < deadline, "no replica reported adapter a"
        time.sleep(0.2)  # polling the controller's state, not synchronisation
    # Each fresh prompt twice: the second hits the prefix cache only on the same replica.
    for _ in range(6):
        ids = prompt()
        handle.generate.remote({"prompt_token_ids": ids}, GREEDY).result()
        again = handle.generate.remote({"prompt_token_ids": ids}, GREEDY).result()
        assert again.num_cached_tokens >= 32
        assert again.outputs[0].token_ids == peft_greedy(tiny_model_dir, adapter, ids)
    assert len(_replicas_serving("a")) == 1
