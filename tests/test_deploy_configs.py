"""Every shipped way to deploy describes an engine that starts where it is
sent: serve_config.yaml (on infra/cluster-local.yaml's head and on
cluster.yaml's GPU workers), the KubeRay RayService, and the serve commands of
docs/SERVING.md.

For each, the test builds the engine config from its own args (the model
directory standing in by a config.json of the same shape; nothing is
downloaded), then checks what the engine checks when it starts: the KV
cache that the budget buys, computed by ModelRunner itself over the model
built on torch's meta device, holds one max_model_len sequence; the
replica's placement bundles (TP x PP ranks per DP rank, plus the replica's
own) fit the nodes the file gives it; on KubeRay, weights and KV cache fit
the worker pod's memory. And they all serve on Serve's direct ingress:
every `ray start` (and the KubeRay pods) carries serve_builder's
variables, on a port apart from Serve's proxy.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rayvllm.config import CPU_KV_CACHE_SPACE_ENV, EngineConfig
from rayvllm.distributed.parallel_state import ParallelContext
from rayvllm.entrypoints.openai.server_args import ServerArgs
from rayvllm.entrypoints.serve_builder import DEFAULT_APP_NAME, direct_ingress_env, split_args
from rayvllm.actors.placement import deployment_bundles
from rayvllm.models.loader import MODEL_REGISTRY
from rayvllm.model_executor.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parent.parent
SERVE_CONFIG = ROOT / "serve_config.yaml"
RAYSERVICE = ROOT / "infra" / "kuberay" / "rayservice.yaml"
LAUNCHER_CONFIGS = [ROOT / "cluster.yaml", ROOT / "infra" / "cluster-local.yaml"]
SERVING_DOC = ROOT / "docs" / "SERVING.md"

Node = dict[str, float]
# The machine CI runs on (2 cores), which is also the head that
# tests/test_deploy.py brings up from infra/cluster-local.yaml.
CI_NODE: Node = {"CPU": 2.0}
# Ray's resources of the EC2 types cluster.yaml names (vCPUs, GPUs).
EC2_NODES: dict[str, Node] = {"g5.2xlarge": {"CPU": 8.0, "GPU": 1.0}, "m6i.xlarge": {"CPU": 4.0}}
# The model the RayService names, by its published config.json dimensions
# (meta-llama/Llama-3.2-1B-Instruct).
LLAMA_32_1B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0, torch_dtype="bfloat16",
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
# What docs/SERVING.md says a tensor_parallel_size=2 command needs, and the nodes that says.
DOC_TP2_NEEDS = "two CPU cores, or two GPUs"
TP2_NODES = ({"CPU": 2.0}, {"CPU": 1.0, "GPU": 2.0})
ONE_CORE = {"CPU": 1.0}


@pytest.fixture(autouse=True)
def node_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped configs start on nodes without the suite's smaller CPU KV
    budget (conftest), so they are checked against the default."""
    monkeypatch.delenv(CPU_KV_CACHE_SPACE_ENV, raising=False)


def write_config_json(directory: Path, dims: dict[str, Any]) -> Path:
    """A model directory holding only config.json (as transformers writes
    it): all the engine config reads."""
    from transformers import LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**dims).to_json_file(str(directory / "config.json"))
    return directory


def fits(bundles: list[Node], nodes: list[Node]) -> bool:
    """Whether Ray could place `bundles` on `nodes` (first fit, largest first).
    Every Ray node also has its RAM as the `memory` resource, which the
    configs do not declare: a replica's one-byte bundle always fits it."""
    free = [{"memory": float(1 << 30), **n} for n in nodes]
    for bundle in sorted(bundles, key=lambda b: -sum(b.values())):
        node = next((n for n in free if all(n.get(k, 0.0) >= v for k, v in bundle.items())), None)
        if node is None:
            return False
        for k, v in bundle.items():
            node[k] -= v
    return True


def meta_runner(config: EngineConfig, ctx: ParallelContext) -> ModelRunner:
    """The rank's ModelRunner with its model built on the meta device: shapes
    and parameter counts without memory or weights."""
    runner = ModelRunner(config, ctx)
    hf = config.model_config.hf_config
    cls = next(MODEL_REGISTRY[a] for a in hf["architectures"] if a in MODEL_REGISTRY)
    with torch.device("meta"):
        runner.model = cls(hf, config.model_config.torch_dtype, ctx).to(config.model_config.torch_dtype)
    return runner


def check_starts(args: dict[str, Any], nodes: list[Node], memory_bytes: int | None = None) -> EngineConfig:
    """What the engine would refuse at start, checked without starting it."""
    engine_args, _ = split_args(dict(args))
    config = engine_args.create_engine_config()
    pc = config.parallel_config
    bundles = deployment_bundles(pc, config.device)
    assert fits(bundles, nodes), f"bundles {bundles} do not fit nodes {nodes}"
    if config.device != "cpu":
        return config  # a GPU's KV budget is measured on the GPU at start
    block = config.cache_config.block_size
    needed = math.ceil(config.model_config.max_model_len / block) + 1
    used = 0
    for pp_rank in range(pc.pipeline_parallel_size):
        runner = meta_runner(config, ParallelContext(tp_size=pc.tensor_parallel_size, pp_rank=pp_rank,
                                                     pp_size=pc.pipeline_parallel_size))
        num_blocks = runner.determine_num_blocks()
        assert num_blocks >= needed, (
            f"max_model_len={config.model_config.max_model_len} needs {needed} blocks; the KV budget holds {num_blocks}"
        )
        assert runner.model is not None
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        used += pc.tensor_parallel_size * (weights + num_blocks * runner.kv_bytes_per_block())
    if memory_bytes is not None:
        # Ray keeps up to 30% of a node's memory for its object store.
        assert used <= 0.7 * memory_bytes, f"weights and KV cache take {used} bytes of {memory_bytes}"
    return config


def kube_quantity(value: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", value)
    assert match, value
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def serve_config_app() -> dict[str, Any]:
    (app,) = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    return app


def rayservice() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE.read_text())


# ---------------------------------------------------------------- starts with its resources


def test_serve_config_starts_on_the_local_clusters_head() -> None:
    app = serve_config_app()
    assert app["name"] == DEFAULT_APP_NAME
    check_starts(app["args"], [CI_NODE])


def test_serve_config_starts_on_cluster_yamls_gpu_workers() -> None:
    """cluster.yaml's head starts with 0 CPUs: the replica goes to the GPU
    workers, as the demo on CPU or with `device: cuda` (the header's advice)."""
    config = yaml.safe_load(LAUNCHER_CONFIGS[0].read_text())
    head = config["available_node_types"][config["head_node_type"]]
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start --head" in c]
    assert "--num-cpus=0" in head_start
    nodes: list[Node] = [{"CPU": 0.0}]
    for name, node_type in config["available_node_types"].items():
        if node_type is not head:
            nodes += [EC2_NODES[node_type["node_config"]["InstanceType"]]] * node_type["max_workers"]
    args = serve_config_app()["args"]
    check_starts(args, nodes)
    check_starts({**args, "device": "cuda"}, nodes)
    assert "device: cuda" in LAUNCHER_CONFIGS[0].read_text()


def test_rayservice_engine_starts_on_its_worker_group(tmp_path: Path) -> None:
    service = rayservice()
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["name"] == DEFAULT_APP_NAME
    args = dict(app["args"])
    assert args["model"] == "/models/Llama-3.2-1B-Instruct"
    args["model"] = str(write_config_json(tmp_path / "Llama-3.2-1B-Instruct", LLAMA_32_1B))
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    nodes: list[Node] = [{"CPU": 0.0}]
    memory = None
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        node = {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
        nodes += [node] * group["replicas"]
        memory = kube_quantity(limits["memory"])
    config = check_starts(args, nodes, memory)
    assert config.model_config.max_model_len == 8192 < LLAMA_32_1B["max_position_embeddings"]


def test_rayservice_without_max_model_len_would_not_start(tmp_path: Path) -> None:
    """The check above is not vacuous: the model's own 131,072 positions
    need more KV cache than the default budget."""
    model = write_config_json(tmp_path / "m", LLAMA_32_1B)
    with pytest.raises(AssertionError, match="max_model_len=131072"):
        check_starts({"model": str(model)}, [{"CPU": 8.0}])


def documented_serve_commands() -> Iterator[str]:
    """The command lines of docs/SERVING.md's "Start a server" block."""
    text = SERVING_DOC.read_text()
    section = text[text.index("## Start a server"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    for line in block.strip().splitlines():
        yield line.split("#", 1)[0].strip()


def documented_command_args(line: str) -> dict[str, Any]:
    words = shlex.split(line)
    if words[:2] == ["serve", "run"] and words[2] == "serve_config.yaml":
        return dict(serve_config_app()["args"])
    if words[:2] == ["serve", "run"]:
        assert words[2] in ("serve_app:app", "serve_app:build_app"), line
        return dict(w.split("=", 1) for w in words[3:])
    assert words[:2] == ["rayvllm", "serve"], line
    from rayvllm.config.engine_args import EngineArgs
    from rayvllm.entrypoints.cli import build_parser, given_args

    ns = build_parser().parse_args(words[1:])
    return {**given_args(ns, EngineArgs), **given_args(ns, ServerArgs)}


def test_documented_serve_commands_start(tiny_model_dir: Path) -> None:
    """The demo commands fit the CI machine; a tensor_parallel_size=2 one
    needs what docs/SERVING.md says, and does not fit one core."""
    assert DOC_TP2_NEEDS in SERVING_DOC.read_text()
    lines = list(documented_serve_commands())
    assert len(lines) >= 4
    for line in lines:
        args = documented_command_args(line)
        if args.get("model") == "/path/to/model":
            args["model"] = str(tiny_model_dir)
        if int(args.get("tensor_parallel_size", 1)) == 2:
            check_starts(args, [TP2_NODES[0]])
            check_starts({**args, "device": "cuda"}, [TP2_NODES[1]])
            with pytest.raises(AssertionError, match="do not fit"):
                check_starts(args, [ONE_CORE])
        else:
            check_starts(args, [CI_NODE])


# ---------------------------------------------------------------- direct ingress


def env_assignments(command: str) -> dict[str, str]:
    """`NAME=value` words that prefix the `ray start` in a shell command."""
    words = shlex.split(command.split(";")[-1])
    return dict(w.split("=", 1) for w in words[: next(i for i, w in enumerate(words) if "=" not in w)])


def direct_port(env: dict[str, str]) -> int:
    port = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    assert env == direct_ingress_env(port, "0.0.0.0"), env
    return port


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_cluster_launcher_starts_every_node_with_direct_ingress(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    starts = [c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    ports = {direct_port(env_assignments(c)) for c in starts}
    assert len(ports) == 1
    assert ports.isdisjoint({yaml.safe_load(SERVE_CONFIG.read_text())["http_options"]["port"]})


def test_rayservice_pods_start_with_direct_ingress() -> None:
    service = rayservice()
    cluster = service["spec"]["rayClusterConfig"]
    serve_port = yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"]
    ports = set()
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", []) if e["name"].startswith("RAY_SERVE_")}
        ports.add(direct_port(env))
    assert len(ports) == 1 and serve_port not in ports
    (port,) = ports
    for group in cluster["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert port in {p["containerPort"] for p in container["ports"]}
