"""Ray Serve LLM over vLLM's CPU engine: the multi-replica peer of
bench/cluster.py. Runs in the peer virtualenv (bench/setup_peers.sh), in
the foreground until SIGINT or SIGTERM:

    .venv-vllm/bin/python bench/peer_serve_llm.py --model DIR --port 8300 --replicas 2

`build_openai_app` with one `LLMConfig`: `--replicas` vLLM engines, each in
a `{"CPU": 1}` placement bundle, behind Serve's proxy and the LLM ingress
(at 0.1 CPU so that both fit two cores), routed by
`PrefixCacheAffinityRouter` (or Serve's power-of-two router with `--router
pow2`). vLLM's CPU settings come from the environment
(bench/throughput.py's VLLM_ENV_DEFAULTS, set by the caller).
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any

import ray
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app
from ray.serve.llm.request_router import PrefixCacheAffinityRouter

# The name clients send as `model`.
MODEL_ID = "peer"


def build(args: argparse.Namespace) -> Any:
    deployment: dict[str, Any] = {"num_replicas": args.replicas, "max_ongoing_requests": 4096}
    if args.router == "prefix":
        deployment["request_router_config"] = {"request_router_class": PrefixCacheAffinityRouter}
    config = LLMConfig(
        model_loading_config={"model_id": MODEL_ID, "model_source": args.model},
        deployment_config=deployment,
        engine_kwargs={
            "dtype": "float32",
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "enable_prefix_caching": True,
            # vLLM's front end reports usage.prompt_tokens_details.cached_tokens only when asked.
            "enable_prompt_tokens_details": True,
        },
        placement_group_config={"bundles": [{"CPU": 1}]},
    )
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0.1}}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=("prefix", "pow2"), default="prefix")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    args = p.parse_args()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # Logical CPUs for every replica (its actor and its bundle take one each)
    # and the ingress: each engine is told its threads by the environment
    # (OMP_NUM_THREADS), not by its reservation.
    ray.init(address="local", include_dashboard=False, num_cpus=2 * args.replicas + 1)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build(args), name="peer", route_prefix="/")
        print(f"peer ready on port {args.port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
