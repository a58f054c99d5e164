"""The Ray KV tier across real Serve replicas: a replica of one LLMServer
deployment computes a document's prefix, which its small pool evicts into
the tier; that replica is then deleted with its app, and a replica of a new
deployment of the same model, which never computed the prefix, loads it
from the tier (counted as cached tokens) and answers with transformers'
tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402

from rayvllm import SamplingParams  # noqa: E402
from rayvllm.config.engine_args import EngineArgs  # noqa: E402
from rayvllm.entrypoints.openai.api_server import LLMServer  # noqa: E402
from rayvllm.entrypoints.serve_builder import replica_placement  # noqa: E402
from rayvllm.kv_offload.ray_tier import KV_TIER_NAMESPACE, directory_name  # noqa: E402

from hf_oracle import hf_greedy  # noqa: E402

BLOCK = 16
NUM_NEW = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def _args(model: Path) -> dict[str, object]:
    # 13 blocks: the document's 4 full blocks leave the pool while the others run.
    return dict(model=str(model), dtype="float32", max_model_len=128, max_num_seqs=2, num_gpu_blocks_override=13,
                kv_offloading_size=1 / 1024, kv_offloading_backend="ray")


@pytest.fixture(scope="module")
def cluster(serve_local: None, tiny_model_dir: Path) -> Iterator[None]:
    oc = EngineArgs(**_args(tiny_model_dir)).create_engine_config().kv_offload_config
    assert oc is not None
    try:
        yield
    finally:
        for app in ("first", "second"):
            serve.delete(app)  # nothing when the app is not there
        try:
            ray.kill(ray.get_actor(directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE))
        except ValueError:
            pass  # never created


def _deploy(name: str, model: Path) -> serve.handle.DeploymentHandle:
    args = _args(model)
    app = LLMServer.options(**replica_placement(EngineArgs(**args))).bind(args)  # type: ignore[attr-defined]
    return serve.run(app, name=name, route_prefix=None)


def test_a_replica_of_a_new_deployment_loads_a_prefix_it_never_computed(cluster: None, tiny_model_dir: Path) -> None:
    rng = random.Random(21)
    doc, *others = [[rng.randrange(5, 4000) for _ in range(4 * BLOCK)] for _ in range(4)]
    first = _deploy("first", tiny_model_dir)
    for prompt in [doc + [7, 8, 9]] + [other + [7] for other in others]:
        first.generate.remote({"prompt_token_ids": prompt}, PARAMS).result()
    serve.delete("first")  # its replica and the engine behind it are gone
    second = _deploy("second", tiny_model_dir)
    out = second.generate.remote({"prompt_token_ids": doc + [10, 11]}, PARAMS).result()
    assert out.num_cached_tokens == 4 * BLOCK
    assert list(out.outputs[0].token_ids) == hf_greedy(tiny_model_dir, doc + [10, 11])[0][:NUM_NEW]
