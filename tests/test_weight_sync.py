"""Weight sync into a running engine (docs/RL.md): by object refs (`ray`)
and over a gloo group, into an in-process engine and a TP=2 engine on Ray;
afterwards the greedy tokens are exactly those of a fresh engine loaded
from the trainer's weights, and the model was updated in place. A bad update (a wrong shape, an unknown name, a
missing weight) is an error and the old weights keep serving. Also
`collective_rpc` with a `worker_extension_cls` and `reset_prefix_cache`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from rayvllm import LLM, HostWeights, SamplingParams
from rayvllm.messages.errors import InvalidParameterError
from rl_oracle import save_weights, trained_weights

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=4 << 20)
# Ray workers of the shared cluster cannot import tests/ modules: the
# extension is tried in process, functions (pickled by value) on Ray.
EXTENSION = dict(worker_extension_cls="rl_oracle:WeightProbe")


def greedy(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path) -> dict[str, torch.Tensor]:
    return trained_weights(tiny_model_dir, seed=1)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, trained: dict[str, torch.Tensor], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[int]]]:
    """Greedy tokens of fresh in-process engines: the original model's, and
    one loaded from the trainer's weights saved as a checkpoint."""
    saved = save_weights(tiny_model_dir, trained, tmp_path_factory.mktemp("trained"))
    result = {}
    for name, model in (("original", tiny_model_dir), ("trained", saved)):
        llm = LLM(model=str(model), **ENGINE)
        result[name] = greedy(llm)
        llm.shutdown()
    assert result["original"] != result["trained"]
    return result


@pytest.fixture(scope="module")
def local_llm(tiny_model_dir: Path, ray_local: None) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model_dir), **ENGINE, **EXTENSION)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def ray_llm(tiny_model_dir: Path, ray_local: None) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model_dir), tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def test_collective_rpc_reaches_every_worker(local_llm: LLM, ray_llm: LLM, tiny_model_dir: Path) -> None:
    assert local_llm.collective_rpc("tp_rank") == [0]
    # A function is given each worker first.
    assert ray_llm.collective_rpc(lambda worker, k: worker.parallel.tp_rank * k, args=(10,)) == [0, 10]
    assert ray_llm.collective_rpc("determine_num_blocks") == local_llm.collective_rpc("determine_num_blocks") * 2
    embedding = local_llm.collective_rpc("embedding_sum")[0]
    assert local_llm.collective_rpc(lambda worker: worker.embedding_sum()) == [embedding]
    with pytest.raises(InvalidParameterError, match="no method"):
        ray_llm.collective_rpc("no_such_method")
    with pytest.raises(InvalidParameterError, match="redefines"):
        LLM(model=str(tiny_model_dir), **ENGINE, worker_extension_cls="rl_oracle:Clash")
    local_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert local_llm.reset_prefix_cache() is True


# How the trainer hands the weights over: a ref to its own put (of a plain
# state dict, or of its HostWeights), or the dict itself.
SHARES = {
    "ray": lambda weights: ray.put(weights),
    "ray-host-weights": lambda weights: ray.put(HostWeights.of(weights)),
    "ray-dict": lambda weights: weights,
    "gloo": lambda weights: weights,
}


def test_host_weights_round_trip_through_the_object_store_without_a_copy(ray_local: None) -> None:
    """Every dtype comes back bit for bit (bfloat16 and float8 carried as
    integers of their width); a fetched tensor is a view of the object
    store's memory, not a copy; a tensor that is not contiguous or needs
    grad goes too."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=generator)
    weights = {
        "f32": base, "bf16": base.to(torch.bfloat16), "f16": base.to(torch.float16),
        "f8": base.to(torch.float8_e4m3fn), "i64": torch.arange(5), "strided": base.t(),
        "grad": base.clone().requires_grad_(),
    }

    @ray.remote
    def fetch(refs: list[ray.ObjectRef]) -> tuple[HostWeights, bool]:
        host = ray.get(refs[0])
        tensors = host.tensors()
        mapped = all(t.data_ptr() == host.arrays[name].ctypes.data for name, t in tensors.items())
        # Back the same way (Ray's own pickling of a float8 tensor fails).
        return HostWeights.of({name: t.clone() for name, t in tensors.items()}), mapped

    back, mapped = ray.get(fetch.remote([ray.put(HostWeights.of(weights))]))
    assert mapped
    got = back.tensors()
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].view(torch.uint8), tensor.detach().contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("how", list(SHARES))
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_sync_weights_gives_a_fresh_engines_tokens(
    how: str, engine: str, local_llm: LLM, ray_llm: LLM, trained: dict[str, torch.Tensor],
    tiny_model_dir: Path, expected: dict[str, list[list[int]]],
) -> None:
    llm = local_llm if engine == "local" else ray_llm
    assert greedy(llm) == expected["original"]

    def storage(worker: object) -> tuple[int, list[int]]:
        """The model's identity and where its weights live (parameters and
        CPU GEMM layouts but oneDNN's opaque one, which is rebuilt)."""
        model = worker.runner.model  # type: ignore[attr-defined]
        planned = [m.gemm for m in model.modules() if getattr(m, "gemm", None)]
        layouts = [t for gemm in planned for c, t in gemm.layouts.items() if c != "mkldnn"]
        return id(model), [t.data_ptr() for t in [*model.parameters(), *layouts]]

    before = llm.collective_rpc(storage)
    # The trainer puts once; every worker fetches the ref itself.
    llm.sync_weights(SHARES[how](trained), backend=how.split("-")[0])
    assert greedy(llm) == expected["trained"]
    # Loaded in place: the same model, every tensor where it was.
    assert llm.collective_rpc(storage) == before
    # Back, in chunks through the four phases, the prompts' cached prefixes
    # (computed by the trained weights) forgotten with the update.
    original = trained_weights(tiny_model_dir, seed=1, scale=0.0)
    names = list(original)
    llm.init_weight_transfer_engine("ray")
    llm.start_weight_update()
    for chunk in (names[: len(names) // 2], names[len(names) // 2 :]):
        llm.update_weights(weights={name: original[name] for name in chunk})
    llm.finish_weight_update()
    assert greedy(llm) == expected["original"]


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda w: w.update({"model.norm.weight": torch.ones(3)}), "shape"),
        (lambda w: w.update({"model.layers.0.mlp.nonsense.weight": torch.ones(3)}), "unknown weight"),
        (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].double()}), "float64"),
        (lambda w: w.pop("model.layers.0.self_attn.k_proj.weight"), "lacks 1"),
    ],
    ids=["shape", "name", "dtype", "missing"],
)
def test_a_bad_update_leaves_the_old_weights_serving(
    break_it: object, message: str, ray_llm: LLM, trained: dict[str, torch.Tensor],
    expected: dict[str, list[list[int]]],
) -> None:
    weights = dict(trained)
    break_it(weights)  # type: ignore[operator]
    with pytest.raises(InvalidParameterError, match=message):
        ray_llm.sync_weights(weights, backend="ray")
    assert greedy(ray_llm) == expected["original"]


def test_nccl_needs_cuda(local_llm: LLM, trained: dict[str, torch.Tensor]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidParameterError, match="nccl needs CUDA"):
        local_llm.sync_weights(trained, backend="nccl")


def test_a_tied_models_state_dict_syncs(tmp_path: Path) -> None:
    """transformers' state dict of a tied model holds `lm_head.weight`,
    which its checkpoint does not: accepted, and the embedding serves as
    the head."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    tied = build_random_model(tmp_path / "tied", RandomModelSpec(tie_word_embeddings=True, seed=4))
    trained = trained_weights(tied, seed=2)
    assert "lm_head.weight" in trained
    fresh = LLM(model=str(save_weights(tied, trained, tmp_path / "trained")), **ENGINE)
    expected = greedy(fresh)
    fresh.shutdown()
    llm = LLM(model=str(tied), **ENGINE)
    llm.sync_weights(trained, backend="gloo")
    assert greedy(llm) == expected
    llm.shutdown()
