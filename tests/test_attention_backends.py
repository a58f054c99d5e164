"""Attention backend selection, overrides, and the backends' plumbing: the
Triton backend end to end (under Triton's interpreter on a CPU-only machine,
on the GPU where there is one), flash-attn's through a stand-in module (see
those tests' docstrings), and real flash-attn where it is installed."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.config import ATTENTION_BACKEND_ENV
from rayvllm.config.engine_args import EngineArgs
from rayvllm.kernels import backends, triton_attention, triton_kv_cache  # noqa: F401 (see below)
from rayvllm.kernels.backends import FlashAttnBackend, TorchBackend, TritonBackend, select_attention_backend
from rayvllm.kernels.kv_layout import KVCacheLayout
from rayvllm.kernels.metadata import AttentionMetadata, VarlenMetadata
from rayvllm.messages.errors import InvalidParameterError

from hf_oracle import hf_greedy

# The Triton kernels are imported above, before any test here sets
# TRITON_INTERPRET: `@triton.jit` reads it when it decorates, so a kernel
# first imported inside a test that sets it would stay interpreted for the
# rest of the session, on a GPU too.
BF16 = torch.bfloat16


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Which optional packages "import"; tests flip entries."""
    available = {"triton": True, "flash_attn": True}
    monkeypatch.setattr(backends, "_importable", lambda name: available[name])
    # Constructing a flash backend imports flash_attn: give it something to import.
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    sys.modules["flash_attn"].flash_attn_varlen_func = None  # type: ignore[attr-defined]
    return available


def _pick(device: str, dtype: torch.dtype = BF16, block_size: int = 16, override: str = "auto", head_size: int = 128):
    return select_attention_backend(device, dtype, head_size, block_size, override)


def test_auto_picks_by_device_and_availability(importable: dict[str, bool], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert type(_pick("cpu")) is TorchBackend  # the interpreter is for tests, never picked
    assert type(_pick("cuda", block_size=256)) is FlashAttnBackend
    assert type(_pick("cuda", block_size=16)) is TritonBackend  # flash-attn pages need 256
    assert type(_pick("cuda", dtype=torch.float32, block_size=256)) is TritonBackend  # flash-attn is half only
    assert type(_pick("cuda", block_size=256, head_size=80 + 4)) is TritonBackend
    # Windowed and soft-capped models (Mistral, Gemma 2) take flash-attn too: it has both.
    windowed = select_attention_backend("cuda", BF16, 128, 256, "auto", windowed=True, softcapped=True)
    assert type(windowed) is FlashAttnBackend
    importable["flash_attn"] = False
    assert type(_pick("cuda", block_size=256)) is TritonBackend
    importable["triton"] = False
    assert type(_pick("cuda", block_size=256)) is TorchBackend


def test_overrides_are_honoured_or_refused_naming_the_field(
    importable: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert type(_pick("cuda", block_size=256, override="torch")) is TorchBackend
    assert type(_pick("cuda", block_size=256, override="triton")) is TritonBackend
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert type(_pick("cpu", dtype=torch.float32, override="triton")) is TritonBackend
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cases = [
        (dict(device="cpu", override="triton"), "TRITON_INTERPRET=1"),
        (dict(device="cpu", override="flash_attn"), "needs CUDA"),
        (dict(device="cuda", override="flash_attn", block_size=16), "multiple of 256"),
        (dict(device="cuda", override="flash_attn", block_size=256, dtype=torch.float32), "float16 and bfloat16"),
        (dict(device="cuda", override="cudnn"), "unknown backend 'cudnn'"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(InvalidParameterError, match=reason) as err:
            _pick(**kwargs)
        assert err.value.param == "attention_backend"
    importable["flash_attn"] = False
    with pytest.raises(InvalidParameterError, match="flash_attn package does not import"):
        _pick("cuda", block_size=256, override="flash_attn")


def test_engine_args_and_environment(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    assert EngineArgs(model=str(tiny_model_dir)).create_engine_config().attention_backend == "triton"
    explicit = EngineArgs(model=str(tiny_model_dir), attention_backend="torch", enforce_eager=True)
    config = explicit.create_engine_config()
    assert config.attention_backend == "torch" and config.enforce_eager
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "cudnn")
    with pytest.raises(InvalidParameterError) as err:
        EngineArgs(model=str(tiny_model_dir)).create_engine_config()
    assert err.value.param == "attention_backend"
    monkeypatch.delenv(ATTENTION_BACKEND_ENV)
    with pytest.raises(InvalidParameterError, match="needs CUDA") as err:
        LLM(model=str(tiny_model_dir), attention_backend="flash_attn", device="cpu", kv_cache_memory_bytes=8 << 20)
    assert err.value.param == "attention_backend"


def _mixed_batch_prompts() -> tuple[list[int], list[list[int]]]:
    prefix = [(37 * i) % 3900 + 5 for i in range(40)]
    return prefix, [
        prefix + [11, 12, 13],  # hits the cached prefix (two full blocks)
        [(53 * i) % 3900 + 5 for i in range(45)],  # chunked: longer than the token budget
        [7, 8, 9, 10],
    ]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _engine_tokens(model_dir: Path, backend: str, **kwargs: object) -> tuple[list[list[int]], LLM]:
    """Cache the prefix with one request, then run the mixed batch: a
    prefix-cache hit, a prompt chunked over steps, decodes alongside them."""
    llm = LLM(
        model=str(model_dir), attention_backend=backend, max_num_seqs=4, max_model_len=512,
        max_num_batched_tokens=32, kv_cache_memory_bytes=16 << 20, **kwargs,
    )
    prefix, prompts = _mixed_batch_prompts()
    _greedy(llm, [prefix + [99]], 1)
    return _greedy(llm, prompts, 6), llm


def test_triton_backend_matches_torch_and_transformers(tiny_model_dir: Path) -> None:
    """The same greedy tokens as the torch backend, which match transformers,
    through prefix hits and chunked prefill (on CUDA also decode graphs)."""
    tokens, llm = _engine_tokens(tiny_model_dir, "triton")
    runner = llm.llm_engine.engine_core.engine_core.executor.runner
    assert runner.attn_backend.name == "triton" and runner.kv_caches[0][0].shape[1] == 16  # NHD
    assert llm.llm_engine.engine_core.make_stats().prefix_cache_stats.hits > 0
    reference, _ = _engine_tokens(tiny_model_dir, "torch")
    assert tokens == reference
    _, prompts = _mixed_batch_prompts()
    for prompt, out in zip(prompts, tokens):
        assert out == hf_greedy(tiny_model_dir, prompt)[0][: len(out)]


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_triton_backend_runs_sliding_windows(tmp_path: Path, arch: str) -> None:
    """A Mistral whose 8-key window every prompt outruns, and a Gemma 2
    (local layers between global ones, soft-capped attention logits): the
    Triton backend's tokens equal the torch backend's and transformers',
    through prefix hits and chunked prefill."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    extra = {"sliding_window": 8}
    if arch == "gemma2":
        extra.update(attn_logit_softcapping=1.0, query_pre_attn_scalar=24)
    model = build_random_model(tmp_path / arch, RandomModelSpec(arch=arch, seed=13, num_hidden_layers=3,
                                                                head_dim=32, norm_weight_std=0.2, extra=extra))
    tokens, llm = _engine_tokens(model, "triton")
    assert llm.llm_engine.engine_core.engine_core.executor.runner.attn_backend.name == "triton"
    assert tokens == _engine_tokens(model, "torch")[0]
    _, prompts = _mixed_batch_prompts()
    for prompt, out in zip(prompts, tokens):
        assert out == hf_greedy(model, prompt)[0][: len(out)]


@pytest.mark.parametrize("lacks", ["supports_sliding_window", "supports_softcap"])
def test_a_backend_without_what_the_model_needs_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lacks: str
) -> None:
    """Every backend here takes windows and caps; one that did not (a
    future kernel) is refused at start, naming attention_backend and what
    the model needs, rather than run without it."""
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    model = build_random_model(tmp_path / "gemma2", RandomModelSpec(
        arch="gemma2", num_hidden_layers=2, head_dim=32, extra={"sliding_window": 8, "attn_logit_softcapping": 1.0}))
    monkeypatch.setattr(TritonBackend, lacks, False)
    with pytest.raises(InvalidParameterError, match="sliding-window" if "window" in lacks else "soft-caps") as e:
        LLM(model=str(model), attention_backend="triton", max_model_len=64, kv_cache_memory_bytes=4 << 20)
    assert e.value.param == "attention_backend"


def _stand_in_flash_attn(calls: list[dict]) -> types.ModuleType:
    """A torch implementation of flash-attn 2's documented
    `flash_attn_varlen_func` for a paged cache, checking the argument
    contract we rely on (int32 offsets and table, NHD pages of a multiple of
    256 slots, causal masking aligned bottom right)."""

    def flash_attn_varlen_func(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
        causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert block_table is not None and block_table.dtype == torch.int32
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        num_blocks, page, kv_heads, head_size = k.shape
        assert v.shape == k.shape and page % 256 == 0 and causal and dropout_p == 0.0
        assert window_size[1] in (-1, 0)  # causal: nothing to the right
        calls.append(dict(cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_k.tolist(), table=block_table.tolist()))
        out = torch.empty_like(q)
        group = q.shape[1] // kv_heads
        for b in range(cu_seqlens_q.numel() - 1):
            q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            k_len = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            assert q1 - q0 <= max_seqlen_q and k_len <= max_seqlen_k
            pages = block_table[b, : -(-k_len // page)].long()
            kb = k[pages].reshape(-1, kv_heads, head_size)[:k_len].repeat_interleave(group, 1)
            vb = v[pages].reshape(-1, kv_heads, head_size)[:k_len].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1], kb) * softmax_scale
            if softcap > 0:
                scores = torch.tanh(scores / softcap) * softcap
            keys, queries = torch.arange(k_len, device=q.device), torch.arange(q1 - q0, device=q.device)
            last = queries[:, None] + k_len - (q1 - q0)
            visible = keys[None, :] <= last
            if window_size[0] >= 0:
                visible &= keys[None, :] >= last - window_size[0]
            weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", weights, vb)
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("window,softcap", [(None, None), (40, 0.5)])
def test_flash_attn_backend_plumbing(
    monkeypatch: pytest.MonkeyPatch, window: int | None, softcap: float | None
) -> None:
    """Checks our plumbing, not flash-attn: NHD caches written by the Triton
    kernel, cu_seqlens_q/cu_seqlens_k and the int32 block table handed to a
    stand-in that implements flash-attn's documented semantics, on a batch
    of a decode, a prefill over a cached prefix and a fresh prefill; with a
    window (its `window_size`) and soft-capped scores (its `softcap`)."""
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _stand_in_flash_attn(calls))
    backend = FlashAttnBackend()
    assert backend.kv_layout is KVCacheLayout.NHD
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton writes the cache
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, head_size, block_size = 4, 2, 32, 256
    k_shape, v_shape = backend.kv_cache_shapes(6, block_size, kv_heads, head_size)
    key_cache, value_cache = torch.zeros(k_shape, device=device), torch.zeros(v_shape, device=device)
    # (context length, new tokens, blocks) per sequence.
    seqs = [(300, 1, [4, 2]), (262, 5, [1, 5]), (7, 7, [3])]
    full_k = [torch.randn(n, kv_heads, head_size, generator=gen).to(device) for n, _, _ in seqs]
    full_v = [torch.randn(n, kv_heads, head_size, generator=gen).to(device) for n, _, _ in seqs]

    def slots(blocks: list[int], positions: range) -> torch.Tensor:
        return torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in positions], device=device)

    # The cached prefixes, as earlier steps would have written them.
    for (n, q_len, blocks), k, v in zip(seqs, full_k, full_v):
        prefix = AttentionMetadata(slot_mapping=slots(blocks, range(n - q_len)), num_decode_tokens=0, prefills=[])
        backend.reshape_and_cache(k[: n - q_len], v[: n - q_len], key_cache, value_cache, prefix)

    q_lens = [q_len for _, q_len, _ in seqs]
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(device)
    new_k = torch.cat([k[n - q_len :] for (n, q_len, _), k in zip(seqs, full_k)])
    new_v = torch.cat([v[n - q_len :] for (n, q_len, _), v in zip(seqs, full_v)])
    step_slots = torch.cat([slots(blocks, range(n - q_len, n)) for n, q_len, blocks in seqs])
    metadata = AttentionMetadata(
        slot_mapping=step_slots,
        num_decode_tokens=1,
        prefills=[],
        varlen=VarlenMetadata(
            query_start_loc=torch.tensor([0, 1, 6, 13], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([300, 262, 7], dtype=torch.int32, device=device),
            seq_start_loc=torch.tensor([0, 300, 562, 569], dtype=torch.int32, device=device),
            block_table=torch.tensor([[4, 2], [1, 5], [3, 0]], dtype=torch.int32, device=device),
            max_query_len=7,
            max_seq_len=300,
        ),
    )
    scale = head_size**-0.5
    backend.reshape_and_cache(new_k, new_v, key_cache, value_cache, metadata)
    out = backend.forward(query, new_k, new_v, key_cache, value_cache, metadata, scale, window, softcap)
    assert calls == [dict(cu_q=[0, 1, 6, 13], cu_k=[0, 300, 562, 569], table=[[4, 2], [1, 5], [3, 0]])]
    start = 0
    for (n, q_len, _), k, v in zip(seqs, full_k, full_v):
        expected = _dense_causal(query[start : start + q_len], k, v, scale, window, softcap)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=2e-5, rtol=1e-4)
        start += q_len


def _dense_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q `[q, H, D]`, the last q positions of a sequence with keys `[L, KVH, D]`
    (each seeing its last `window` keys, scores capped at `softcap`, where given)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys, queries = torch.arange(k.shape[0], device=q.device), torch.arange(q.shape[0], device=q.device)
    last = queries[:, None] + k.shape[0] - q.shape[0]
    visible = keys[None, :] <= last
    if window is not None:
        visible &= keys[None, :] > last - window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v).float()


def test_flash_attn_backend_in_the_engine(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks our plumbing, not flash-attn: the runner's varlen metadata
    (cu_seqlens_k from seq_start_loc, int32 table in batch order) through
    the stand-in gives the torch backend's greedy tokens with 256-slot pages.
    Eager: the stand-in reads its offsets on the host, which a CUDA graph
    capture (on a GPU) cannot hold."""
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _stand_in_flash_attn(calls))
    monkeypatch.setattr(FlashAttnBackend, "unavailable_reason", classmethod(lambda cls, *args: None))
    prompts = [[(31 * i) % 3900 + 5 for i in range(n)] for n in (40, 3, 300)]
    tokens = {}
    for backend in ("flash_attn", "torch"):
        llm = LLM(
            model=str(tiny_model_dir), attention_backend=backend, block_size=256, max_num_seqs=4,
            max_model_len=512, max_num_batched_tokens=256, kv_cache_memory_bytes=16 << 20, enforce_eager=True,
        )
        tokens[backend] = _greedy(llm, prompts, 4)
    assert tokens["flash_attn"] == tokens["torch"]
    assert any(len(c["cu_q"]) == 4 and c["cu_k"][-1] > 256 for c in calls)  # mixed steps, pages crossed


@pytest.mark.skipif(
    not torch.cuda.is_available() or not backends._importable("flash_attn"), reason="needs CUDA and flash-attn"
)
def test_real_flash_attn_close_to_triton(tiny_model_dir: Path) -> None:
    """flash-attn itself (bfloat16, 256-slot pages): its greedy logprobs stay
    close to the Triton backend's on the same prompts."""
    prompts = [[(31 * i) % 3900 + 5 for i in range(n)] for n in (40, 3, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = {}
    for backend in ("flash_attn", "triton"):
        llm = LLM(
            model=str(tiny_model_dir), attention_backend=backend, dtype="bfloat16", block_size=256,
            max_num_seqs=4, max_model_len=512, kv_cache_memory_bytes=64 << 20,
        )
        outs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for flash, triton in zip(outs["flash_attn"], outs["triton"]):
        first = flash.outputs[0].token_ids[0]
        assert first == triton.outputs[0].token_ids[0]
        assert abs(flash.outputs[0].logprobs[0][first].logprob - triton.outputs[0].logprobs[0][first].logprob) < 0.05
