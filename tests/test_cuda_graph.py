"""CUDA-graph decode: the capture sizes, the padding of a batch up to one,
and the runner's replay path. No GPU here: the replay test swaps capture for
an eager stand-in that re-runs the forward on the same static buffers, which
checks the buffers, the padding rows and the fallback, not CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.model_executor import model_runner
from rayvllm.model_executor.cuda_graph import CudaGraphRunner, DecodeInputs, capture_sizes, fill_padded, padded_size


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))


def test_padded_size() -> None:
    sizes = capture_sizes(40)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 32)] == [1, 2, 4, 8, 8, 16, 16, 32, 32]
    assert padded_size(33, sizes) is None


def test_fill_padded_pads_with_harmless_rows() -> None:
    """Stale values from a bigger earlier step must not survive in the rows
    the graph will read."""
    size, max_blocks = 8, 4
    buf = DecodeInputs(
        input_ids=np.full(size, 77, dtype=np.int64),
        positions=np.full(size, 77, dtype=np.int64),
        slot_mapping=np.full(size, 77, dtype=np.int64),
        seq_lens=np.full(size, 77, dtype=np.int32),
        seq_start_loc=np.zeros(size + 1, dtype=np.int32),
        block_table=np.full((size, max_blocks), 77, dtype=np.int32),
    )
    fill_padded(
        buf, 4,
        input_ids=np.array([10, 11, 12]), positions=np.array([5, 17, 40]), slot_mapping=np.array([21, 49, 88]),
        seq_lens=np.array([6, 18, 41]), block_table=np.array([[1, 0, 0, 0], [2, 3, 0, 0], [4, 5, 6, 0]]),
    )
    assert buf.input_ids[:4].tolist() == [10, 11, 12, 0]
    assert buf.positions[:4].tolist() == [5, 17, 40, 0]
    assert buf.slot_mapping[:4].tolist() == [21, 49, 88, -1]
    assert buf.seq_lens[:4].tolist() == [6, 18, 41, 1]
    assert buf.seq_start_loc[:5].tolist() == [0, 6, 24, 65, 66]
    assert buf.block_table[:4].tolist() == [[1, 0, 0, 0], [2, 3, 0, 0], [4, 5, 6, 0], [0, 0, 0, 0]]
    assert buf.input_ids[4:].tolist() == [77] * 4  # rows past the graph's size are not read


def test_decode_replay_matches_eager(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five requests finishing one step apart: decode batches of 5 (above the
    largest size: eager), 4, 3 (padded to 4), 2 and 1 replay, and the greedy
    tokens equal the torch backend's."""
    replays: list[int] = []

    def eager_capture(self: CudaGraphRunner, size: int, pool: object) -> tuple:
        out = self._run_static(size)

        def replay() -> None:
            replays.append(size)
            out.copy_(self._run_static(size))

        return replay, out

    monkeypatch.setattr(CudaGraphRunner, "_capture", eager_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(model_runner, "capture_sizes", lambda max_num_seqs: [1, 2, 4])
    prompts = [{"prompt_token_ids": [(29 * i + j) % 3900 + 5 for j in range(6 + 9 * i)]} for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (2, 3, 4, 5, 6)]
    tokens = {}
    for backend in ("triton", "torch"):
        llm = LLM(
            model=str(tiny_model_dir), attention_backend=backend, max_num_seqs=8, max_model_len=256,
            kv_cache_memory_bytes=8 << 20,
        )
        runner = llm.llm_engine.engine_core.engine_core.executor.runner
        if backend == "triton":
            runner._capture_cuda_graphs()
            assert replays == []  # capturing does not replay
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]
    assert replays == [4, 4, 2, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_graphs_match_eager_on_cuda(tiny_model_dir: Path) -> None:
    """Captured graphs (1, 2, 4, 8 here) replay every decode step of the
    staggered batch and give the eager run's greedy tokens."""
    prompts = [{"prompt_token_ids": [(29 * i + j) % 3900 + 5 for j in range(6 + 9 * i)]} for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (2, 3, 4, 5, 6)]
    tokens = {}
    for eager in (False, True):
        llm = LLM(
            model=str(tiny_model_dir), attention_backend="triton", enforce_eager=eager, max_num_seqs=8,
            max_model_len=256, kv_cache_memory_bytes=8 << 20,
        )
        runner = llm.llm_engine.engine_core.engine_core.executor.runner
        assert (runner.cuda_graphs is None) == eager
        replayed: list[int] = []
        if not eager:
            assert runner.cuda_graphs.sizes == [1, 2, 4, 8]
            run = runner.cuda_graphs.run
            runner.cuda_graphs.run = lambda ids, *a: replayed.append(len(ids)) or run(ids, *a)
        tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            assert replayed == [5, 4, 3, 2, 1]
    assert tokens[False] == tokens[True]
