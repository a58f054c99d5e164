"""Multi-LoRA on the Ray path (SchedulerActor + WorkerActor): adapters and
the base model in one batch match transformers + PEFT with one worker
(async scheduling asked for), under tensor and pipeline parallelism, where each
rank loads its own shard of every adapter, and over two data-parallel
ranks, each with its own slots."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rayvllm import LLM, LoRARequest, SamplingParams  # noqa: E402

from hf_oracle import NUM_NEW  # noqa: E402
from lora_oracle import build_adapter, peft_greedy  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("ray-adapters")
    return [
        LoRARequest("a", 1, str(build_adapter(tiny_model_dir, root / "a", seed=11, rank=8))),
        LoRARequest("b", 2, str(build_adapter(tiny_model_dir, root / "b", seed=12, rank=4,
                                              targets=("q_proj", "k_proj", "o_proj", "down_proj")))),
        LoRARequest("c", 3, str(build_adapter(tiny_model_dir, root / "c", seed=13, rank=16,
                                              targets=("v_proj", "gate_proj", "up_proj")))),
    ]


@pytest.mark.parametrize(
    "sizes",
    [dict(distributed_executor_backend="ray", async_scheduling=True), dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
     dict(data_parallel_size=2)],
    ids=["one-worker", "tp2", "pp2", "dp2"],
)
def test_ray_path_mixed_adapters_match_peft(
    ray_local: None, tiny_model_dir: Path, adapters: list[LoRARequest], sizes: dict
) -> None:
    rng = random.Random(5)
    loras = [None, adapters[0], adapters[1], adapters[2], adapters[0], None, adapters[2]]
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(4, 40))] for _ in loras]
    # Two slots for three adapters: the third waits for a slot and reloads one.
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              **sizes)
    _assert_greedy_matches_peft(llm, tiny_model_dir, prompts, loras)


def _assert_greedy_matches_peft(
    llm: LLM, model: Path, prompts: list[list[int]], loras: list[LoRARequest | None]
) -> None:
    """Greedy tokens of each prompt under its adapter equal transformers + PEFT's; shuts `llm` down."""
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False,
            lora_request=loras,
        )
    finally:
        llm.shutdown()
    for prompt, lora, out in zip(prompts, loras, outs):
        assert out.outputs[0].token_ids == peft_greedy(model, Path(lora.lora_path) if lora else None, prompt), lora


def test_fused_phi3_adapter_under_tensor_parallelism(ray_local: None, tmp_path: Path) -> None:
    """Phi-3's adapters target its fused q/k/v and gate/up: each TP rank
    takes its rows of every shard of B, as it takes the base weight's."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    model = build_random_model(tmp_path / "phi3", RandomModelSpec(arch="phi3", seed=9))
    adapter = build_adapter(model, tmp_path / "adapter", seed=10, rank=8,
                            targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    rng = random.Random(6)
    loras = [LoRARequest("p", 1, str(adapter)), None]
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(4, 40))] for _ in loras]
    llm = LLM(model=str(model), dtype="float32", enable_lora=True, max_lora_rank=8, tensor_parallel_size=2)
    _assert_greedy_matches_peft(llm, model, prompts, loras)
