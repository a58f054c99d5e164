"""Multi-LoRA: greedy parity with transformers + PEFT on the same adapters,
adapters and the base model mixed in one step, more adapters than slots,
prefix caching keyed by adapter, and the errors of adapters the engine
cannot run."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from rayvllm import LLM, LoRARequest, SamplingParams
from rayvllm.core.request import Request
from rayvllm.entrypoints.cli import build_parser
from rayvllm.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels, parse_lora_modules
from rayvllm.lora.extension import LoRAExtension
from rayvllm.lora.slots import LoRASlots
from rayvllm.messages.block_hash import hash_request_tokens, request_extra_keys
from rayvllm.messages.errors import InvalidParameterError, ModelNotFoundError
from rayvllm.messages.request import EngineCoreRequest
from rayvllm.utils.random_model import RandomModelSpec, build_random_model

from hf_oracle import NUM_NEW
from lora_oracle import ALL_TARGETS, build_adapter, peft_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": build_adapter(tiny_model_dir, root / "a", seed=1, rank=8),
        "b": build_adapter(tiny_model_dir, root / "b", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")),
        "c": build_adapter(tiny_model_dir, root / "c", seed=3, rank=16, use_rslora=True,
                           targets=("k_proj", "o_proj", "gate_proj", "up_proj")),
    }


def _lora(adapters: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, "abc".index(name) + 1, str(adapters[name]))


def _prompts(seed: int, n: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(5, 4000) for _ in range(rng.randint(4, 40))] for _ in range(n)]


class _StepRecorder:
    """The adapter slots of every step's tokens, and every slot load, seen
    through the runner's LoRA manager."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.engine_core.engine_core.executor.runner
        manager = next(ext.manager for ext in runner.extensions if isinstance(ext, LoRAExtension))
        assert manager is not None
        self.steps: list[set[int]] = []
        self.loads: list[tuple[int, int]] = []
        set_step, activate = manager.set_step, manager.activate

        def recording_set_step(req_ids: list[str], q_lens: np.ndarray) -> None:
            self.steps.append({manager.req_slots.get(r, -1) for r in req_ids})
            set_step(req_ids, q_lens)

        def recording_activate(slot: int, request: LoRARequest) -> None:
            if manager.slot_ids[slot] != request.lora_int_id:
                self.loads.append((slot, request.lora_int_id))
            activate(slot, request)

        manager.set_step = recording_set_step  # type: ignore[method-assign]
        manager.activate = recording_activate  # type: ignore[method-assign]


def _check(llm_outputs: list, prompts: list[list[int]], names: list[str | None], model: Path, adapters: dict[str, Path]) -> None:
    for prompt, name, out in zip(prompts, names, llm_outputs):
        expected = peft_greedy(model, adapters[name] if name else None, prompt)
        assert out.outputs[0].token_ids == expected, name


def test_adapter_matches_peft_and_changes_the_output(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16)
    prompts = _prompts(1, 3)
    for name in ("a", "b", "c"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=_lora(adapters, name))
        _check(outs, prompts, [name] * 3, tiny_model_dir, adapters)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids != peft_greedy(tiny_model_dir, None, prompt)


def test_adapters_and_base_share_one_step(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    recorder = _StepRecorder(llm)
    names: list[str | None] = [None, "a", "b", "c", None, "a", "c", "b"]
    prompts = _prompts(2, len(names))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[_lora(adapters, n) for n in names])
    _check(outs, prompts, names, tiny_model_dir, adapters)
    # The first step prefills all eight: three adapters and the base model together.
    assert recorder.steps[0] == {-1, 0, 1, 2}
    assert sum(1 for step in recorder.steps if len(step) == 4) >= NUM_NEW


def test_more_adapters_than_slots_evicts_and_stays_exact(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_cpu_loras=2)
    recorder = _StepRecorder(llm)
    names: list[str | None] = ["a", "b", "c", None, "c", "a", "b", None, "a"]
    prompts = _prompts(3, len(names))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[_lora(adapters, n) for n in names])
    _check(outs, prompts, names, tiny_model_dir, adapters)
    assert all(len(step - {-1}) <= 2 for step in recorder.steps)
    # Three adapters through two slots: some slot was reloaded.
    assert len(recorder.loads) > 2
    # Again, with adapters still resident or in the host cache: still exact.
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                         lora_request=[_lora(adapters, n) for n in names])
    _check(again, prompts, names, tiny_model_dir, adapters)


def test_prefix_cache_is_keyed_by_adapter(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              enable_prefix_caching=True)
    prompt = _prompts(4, 1, prefix=list(range(100, 164)))[0]
    order: list[str | None] = [None, "a", "b", "a", None]
    cached = []
    for name in order:
        out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=_lora(adapters, name))[0]
        assert out.outputs[0].token_ids == peft_greedy(tiny_model_dir, adapters[name] if name else None, prompt)
        cached.append(out.num_cached_tokens)
    # First time under each adapter (and base): nothing to share; the repeats hit.
    assert cached[:3] == [0, 0, 0]
    assert cached[3] >= 64 and cached[4] >= 64


def test_adapters_the_engine_cannot_run_are_refused(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7]}
    plain = LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=2)
    with pytest.raises(InvalidParameterError, match="enable_lora"):
        plain.generate(prompt, GREEDY, use_tqdm=False, lora_request=_lora(adapters, "a"))
    with pytest.raises(InvalidParameterError, match="max_loras"):
        LLM(model=str(tiny_model_dir), max_loras=2)
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, max_num_seqs=2)
    with pytest.raises(InvalidParameterError, match="max_lora_rank=8") as e:
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=_lora(adapters, "c"))
    assert "lora_request" in e.value.param
    with pytest.raises(InvalidParameterError, match="no adapter_config.json"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("gone", 9, str(tmp_path / "gone")))
    embed = build_adapter(tiny_model_dir, tmp_path / "embed", seed=4, targets=("embed_tokens", "q_proj"))
    with pytest.raises(InvalidParameterError, match="target modules"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("embed", 10, str(embed)))
    llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(adapters["a"])))
    with pytest.raises(InvalidParameterError, match="already names"):
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("y", 1, str(adapters["b"])))
    with pytest.raises(InvalidParameterError, match="lora_int_id"):
        LoRARequest("zero", 0, str(adapters["a"]))
    # The engine still serves after every refusal.
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=_lora(adapters, "a"))[0]
    assert out.outputs[0].token_ids == peft_greedy(tiny_model_dir, adapters["a"], prompt["prompt_token_ids"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "olmo2", "gemma2", "gemma3", "phi3"])
def test_biases_and_qk_norms_around_adapters_match_peft(arch: str, tmp_path: Path) -> None:
    """Q/K/V biases (Qwen2), per-head q/k norms (Qwen3), q/k norms over
    all heads with norms after each sublayer (OLMo 2), and Gemma's norms on
    both sides, GeGLU and soft caps (Gemma 2 and 3) around the adapted
    projections; Phi-3's adapters target its fused q/k/v and gate/up whole."""
    extra = {"attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 24} if arch == "gemma2" else {}
    model = build_random_model(tmp_path / arch, RandomModelSpec(arch=arch, head_dim=32, seed=7, extra=extra))
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if arch == "phi3" else ALL_TARGETS
    adapter = build_adapter(model, tmp_path / "adapter", seed=8, rank=8, targets=targets)
    llm = LLM(model=str(model), dtype="float32", enable_lora=True, max_lora_rank=8)
    prompts = _prompts(6, 2)
    loras = [LoRARequest("x", 1, str(adapter)), None]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    assert outs[0].outputs[0].token_ids == peft_greedy(model, adapter, prompts[0])
    assert outs[1].outputs[0].token_ids == peft_greedy(model, None, prompts[1])


# ---- the pieces on their own ----------------------------------------------------------


def _request(req_id: str, lora_id: int | None) -> Request:
    lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, "/unused")
    return Request(EngineCoreRequest(req_id, [5, 6], SamplingParams(max_tokens=1), None, lora_request=lora))


def test_slots_are_pinned_while_running_and_reused_lru() -> None:
    slots = LoRASlots(max_loras=2)
    r1, r2, r3, r4, base = (_request("1", 1), _request("2", 2), _request("3", 3), _request("4", 2),
                            _request("b", None))
    assert slots.acquire(r1) == 0 and slots.acquire(r2) == 1
    assert not slots.can_admit(r3) and slots.can_admit(base) and slots.acquire(base) == -1
    assert slots.can_admit(r4) and slots.acquire(r4) == 1  # adapter 2 is resident: shared
    slots.release(r2)
    assert not slots.can_admit(r3)  # adapter 2 still runs (r4)
    slots.release(r1)
    assert slots.acquire(r3) == 0  # adapter 1 was idle: its slot is reused
    slots.release(r1)  # twice is harmless
    assert slots.refs == {1: 0, 2: 1, 3: 1}


def test_prefix_hashes_differ_by_adapter() -> None:
    tokens = list(range(32))
    base = hash_request_tokens(16, tokens, request_extra_keys(None, None))
    one = hash_request_tokens(16, tokens, request_extra_keys(None, 1))
    two = hash_request_tokens(16, tokens, request_extra_keys(None, 2))
    assert len({base[0], one[0], two[0]}) == 3 and len({base[1], one[1], two[1]}) == 3
    assert request_extra_keys("s", None) == ("cache_salt", "s")


def test_lora_modules_forms_and_errors() -> None:
    assert parse_lora_modules("a=/p b=/q") == [LoRAModulePath("a", "/p"), LoRAModulePath("b", "/q")]
    assert parse_lora_modules(['{"name": "a", "path": "/p", "base_model_name": "m"}']) == [
        LoRAModulePath("a", "/p", "m")
    ]
    for bad in (["a"], ["=p"], ['{"name": "a"}'], ["{not json"]):
        with pytest.raises(InvalidParameterError, match="lora_modules"):
            parse_lora_modules(bad)
    ns = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/p", "b=/q"])
    assert ns.lora_modules == ["a=/p", "b=/q"] and ns.enable_lora is True


def test_served_names_resolve_to_adapters() -> None:
    models = OpenAIServingModels(["base"], 128, lora_modules=parse_lora_modules("a=/p"))
    assert models.resolve(None) == ("base", None)
    name, lora = models.resolve("a")
    assert name == "a" and lora is not None and lora.lora_int_id == 1 and lora.base_model_name == "base"
    with pytest.raises(ModelNotFoundError):
        models.resolve("b")
    with pytest.raises(InvalidParameterError, match="already served"):
        models.load_lora_adapter("base", "/q")
    models.unload_lora_adapter("a")
    # A name loaded again is another adapter to the engine: a new id.
    assert models.load_lora_adapter("a", "/q").lora_int_id == 2
    cards = {c.id: c for c in models.show_models().data}
    assert cards["a"].parent == "base" and cards["a"].root == "/q"
