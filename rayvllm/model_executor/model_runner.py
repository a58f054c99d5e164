"""Runs one scheduler step on one device: inputs, forward, sampling.

The runner mirrors the scheduler's view of each request in an `InputBatch`
(full data arrives once, then deltas) and appends the tokens it samples
itself, so a decode step needs nothing from the scheduler but block ids.

Features (LoRA, speculative decoding, structured outputs, KV copies to a
second tier) join the step as `ModelRunnerExtension`s (extension.py), given
by whoever builds the runner; the runner imports none of them.

The attention backend (kernels/backends.py) decides the KV cache layout and
which attention metadata a step carries. On CUDA the runner also sizes the
KV cache by profiling the largest step, and replays CUDA graphs for decode
steps (cuda_graph.py). Host syncs per step on CUDA: the sampled ids'
`.tolist()`, plus the sampler's uploads of per-request tensors when a row
samples randomly or uses penalties, biases or logprobs (pageable copies).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rayvllm.config import EngineConfig
from rayvllm.distributed.parallel_state import (
    ParallelContext,
    recv_from_prev_stage,
    send_to_next_stage,
    tp_share_new_tokens,
)
from rayvllm.kernels import cpu_attention, cpu_gemm
from rayvllm.kernels.backends import select_attention_backend
from rayvllm.kernels.host_memory import empty_huge, keep_freed_memory, return_freed_memory
from rayvllm.kernels.metadata import AttentionMetadata, PrefillSeq, VarlenMetadata
from rayvllm.kernels.omp_runtime import release_thread_team
from rayvllm.messages.engine_types import LogprobsLists, ModelRunnerOutput
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.model_executor.cuda_graph import CudaGraphRunner, capture_sizes
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.extension_context import (
    BeginStepContext,
    LogitsContext,
    ModelLoadContext,
    PrepareInputsContext,
    SampleContext,
)
from rayvllm.model_executor.gpu_memory import kv_cache_budget, profile_memory
from rayvllm.model_executor.input_batch import CachedRequestState, InputBatch
from rayvllm.model_executor.pooler import Pooler
from rayvllm.model_executor.prompt_logprobs import compute_prompt_logprobs
from rayvllm.model_executor.sampler import Sampler
from rayvllm.model_executor.sampling_metadata import RequestSamplingState, build_sampling_metadata
from rayvllm.models.honoured import kv_window, layer_windows
from rayvllm.models.interface import CausalLM
from rayvllm.models.loader import build_model, iterate_weights

@dataclass
class _StepPlan:
    """Flat-batch layout of one step: requests in batch order (decodes first;
    on the torch backend a verifying request counts as decodes, one
    single-query row per token)."""

    states: list[CachedRequestState]
    q_lens: np.ndarray
    starts: np.ndarray
    cu_q: np.ndarray
    num_decodes: int


class ModelRunner:
    """One rank's runner. Under tensor/pipeline parallelism every rank of a
    group runs `execute_model` on the same SchedulerOutput; only the driver
    rank (`ParallelContext.is_driver`) samples and returns tokens, the others
    return an empty output and append the tokens the scheduler sends back
    (under async scheduling: the tokens the driver hands them at the end of
    the step, see `shares_tokens`).
    `extensions` are the features this rank runs (see extension.py), called
    in their order at every hook."""

    def __init__(
        self,
        config: EngineConfig,
        parallel: ParallelContext | None = None,
        extensions: Sequence[ModelRunnerExtension] = (),
    ) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.device = torch.device(config.device)
        self.dtype = self.model_config.torch_dtype
        self.block_size = self.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size
        )
        self.sampler = Sampler()
        self.extensions = list(extensions)
        # Under async scheduling the scheduler sends no sampled tokens (it
        # has not seen them yet): TP rank 0 hands each step's to its group.
        self.shares_tokens = config.scheduler_config.async_scheduling and self.parallel.tp_size > 1
        # A pooling runner returns vectors and never computes logits.
        pooler_config = self.model_config.pooler_config
        self.pooler = Pooler(pooler_config) if pooler_config is not None else None
        # Sliding-window layers need a backend that takes a window, capped logits one that caps.
        windowed = any(w is not None for w in layer_windows(self.model_config.hf_config))
        softcapped = self.model_config.hf_config.get("attn_logit_softcapping") is not None
        self.attn_backend = select_attention_backend(
            self.device, self.dtype, self.model_config.head_dim, self.block_size, config.attention_backend, windowed,
            softcapped,
        )
        self.on_cpu = self.device.type == "cpu"
        # The persistent block table, shared (not copied) with the decode kernel.
        self.block_table_tensor = torch.from_numpy(self.input_batch.block_table)
        if windowed and not self.attn_backend.supports_sliding_window:
            raise InvalidParameterError(
                "attention_backend", f"the model has sliding-window layers, which the {self.attn_backend.name} "
                "backend does not run; 'auto' picks one that does",
            )
        if softcapped and not self.attn_backend.supports_softcap:
            raise InvalidParameterError(
                "attention_backend", f"the model soft-caps its attention logits (attn_logit_softcapping), which "
                f"the {self.attn_backend.name} backend does not do; 'auto' picks one that does",
            )
        self.use_c_decode = (
            not self.attn_backend.uses_varlen_metadata
            and self.on_cpu
            and self.dtype == torch.float32
            and cpu_attention.supports(self.model_config.head_dim, self.block_size)
        )
        # Prefills through the C kernel too, over the cache (docs/BENCHMARKS.md, issue 30).
        self.use_c_prefill = self.use_c_decode and cpu_attention.supports_prefill(
            self.model_config.head_dim, self.block_size
        )
        # Batch-invariant mode: every token's attention summed as the decode
        # kernel sums it, every GEMM through the C kernel (config.deterministic).
        self.deterministic = config.deterministic
        if self.deterministic and not (self.use_c_decode and cpu_gemm.available()):
            raise InvalidParameterError(
                "deterministic", "needs the CPU's C attention and GEMM kernels, which are not available here"
            )
        self.model: CausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        # Asleep at level 1 on a GPU: the weights wait in host memory.
        self.weights_on_host = False
        self.cuda_graphs: CudaGraphRunner | None = None
        # How far back any layer reads a query's keys, known once the models are (`kv_window`).
        self.kv_window: int | None = None

    # ---- setup -------------------------------------------------------------------

    def load_model(self) -> None:
        if self.on_cpu:
            keep_freed_memory()
        torch.manual_seed(self.model_config.seed)
        self.model = self._build_model(iterate_weights(Path(self.model_config.model), self.dtype))
        ctx = ModelLoadContext(
            self.model, self.dtype, self.device, self.attn_backend.fused_cpu_kv_write, self._to_device
        )
        for ext in self.extensions:
            ext.load_model(ctx)
        # The scheduler may release blocks behind a window: the torch path must not gather them.
        self.kv_window = kv_window(layer.window for model in self._kv_models() for layer in model.attention_layers())

    def _build_model(self, weights: Iterable[tuple[str, torch.Tensor]]) -> CausalLM:
        return build_model(
            self.model_config.hf_config,
            self.dtype,
            weights,
            str(self.device),
            self.parallel,
            fused_kv_write=self.attn_backend.fused_cpu_kv_write,
            with_lm_head=self.pooler is None,
            batch_invariant=self.deterministic,
        )

    def reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The target model's weights replaced by `weights` (HF names and
        full shapes, every tensor of the checkpoint, checked by the receiver
        first): copied into the live parameters and GEMM layouts, so CUDA
        graphs and KV bindings stay as they are. A model freed by sleep
        (level 2) is built from them instead."""
        if self.model is not None:
            self.model.load_weights_in_place(weights)
            return
        self.model = self._build_model(weights)

    def sleep(self, level: int) -> None:
        """Free the KV cache (its contents are lost: the scheduler forgot
        them first) and give its memory back to the OS. Level 1 keeps the
        weights in host memory (moved there from a GPU; a CPU model is
        there already); level 2 frees them too (`wake_up` reloads the
        checkpoint, or a weight update rebuilds the model meanwhile)."""
        if self.model is not None:
            for model in self._kv_models():
                for layer in model.attention_layers():
                    layer.unbind_kv_cache()
        self.kv_caches = []
        self.cuda_graphs = None
        if level == 2:
            self.model = None
        elif self.model is not None and not self.on_cpu:
            self.model.to("cpu")
            self.weights_on_host = True
        if self.on_cpu:
            return_freed_memory()
        else:
            torch.cuda.empty_cache()

    def wake_up(self, tags: Sequence[str]) -> None:
        """Bring back what `tags` name ("weights", "kv_cache"); the KV cache
        needs the weights awake (it is bound to the model's layers)."""
        if "weights" in tags:
            if self.model is None:
                self.model = self._build_model(iterate_weights(Path(self.model_config.model), self.dtype))
            elif self.weights_on_host:
                self.model.to(self.device)
            self.weights_on_host = False
        if "kv_cache" in tags and not self.kv_caches:
            if self.model is None or self.weights_on_host:
                raise InvalidParameterError("tags", "wake the weights before the KV cache (or sync new weights)")
            self.initialize_kv_cache(self.num_blocks)

    def _kv_models(self) -> list[CausalLM]:
        """Models whose KV this rank caches in the same blocks: the target,
        then those of its extensions (a draft model)."""
        assert self.model is not None
        return [self.model, *(model for ext in self.extensions for model in ext.kv_cache_models())]

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block across this rank's layers and KV heads."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
            for model in self._kv_models()
            for layer in model.attention_layers()
        )

    def determine_num_blocks(self) -> int:
        """Blocks (including the null block) that fit the KV memory budget,
        capped at what `max_num_seqs` full-length sequences could ever use."""
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            # The profiling forward needs caches to point at: one block each.
            self._bind_kv_caches(1)
            budget = kv_cache_budget(profile_memory(self.device, self.profile_run), cc.gpu_memory_utilization)
        else:
            budget = cc.CPU_KV_CACHE_BYTES
        max_useful = self.config.scheduler_config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        num_blocks = min(budget // self.kv_bytes_per_block(), max_useful)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {self.kv_bytes_per_block()} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's caches in the backend's layout, then (on
        CUDA, unless `enforce_eager`) capture the decode graphs, which need
        the caches' final addresses. The last step of setup, so it frees
        this thread's OpenMP team: steps often run on another thread (an
        actor's channel or loop thread, the serving step thread), and two
        live teams slow every parallel region (kernels/omp_runtime.py); a
        thread that goes on to step simply makes its team again."""
        self.num_blocks = num_blocks
        self.kv_caches = self._bind_kv_caches(num_blocks)
        for ext in self.extensions:
            ext.initialize_kv_cache(self.kv_caches)
        if self._cuda_graphs_enabled():
            self._capture_cuda_graphs()
        release_thread_team()

    def _bind_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caches = []
        # Zeroed, not empty: padded decode rows read unused slots, and NaN
        # garbage there would survive the mask as 0 * NaN.
        for layer in (layer for model in self._kv_models() for layer in model.attention_layers()):
            k_shape, v_shape = self.attn_backend.kv_cache_shapes(
                num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim
            )
            k, v = (self._zeroed_cache(shape) for shape in (k_shape, v_shape))
            layer.bind_kv_cache(k, v, self.attn_backend)
            caches.append((k, v))
        return caches

    def _zeroed_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A KV cache tensor; on the CPU on huge pages, since decode attention
        streams it. Written through at start: pages left for the kernel to
        fault in as blocks are first used cost steps more than the write
        saves at start (docs/BENCHMARKS.md, issue 26)."""
        if self.device.type == "cpu":
            return empty_huge(tuple(shape), self.dtype).zero_()
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _cuda_graphs_enabled(self) -> bool:
        """Graphs are for single-rank CUDA workers whose backend can be
        captured; collectives inside captured graphs are not supported here."""
        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and self.attn_backend.supports_cuda_graphs
            and self.parallel.tp_size == 1
            and self.parallel.pp_size == 1
            and all(ext.supports_cuda_graphs for ext in self.extensions)
        )

    @torch.inference_mode()
    def _capture_cuda_graphs(self) -> None:
        assert self.model is not None
        graphs = CudaGraphRunner(
            self.model,
            capture_sizes(self.config.scheduler_config.max_num_seqs),
            self.input_batch.block_table.shape[1],
            self.max_model_len,
            self.device,
        )
        graphs.capture()
        self.cuda_graphs = graphs

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can send: `max_num_batched_tokens`
        dummy tokens in up to `max_num_seqs` fresh sequences, then logits and
        sampling (random, top-p, top-k, logprobs) for each sequence. Writes
        no KV (slots of -1); attention reads only the null block."""
        assert self.model is not None
        sc = self.config.scheduler_config
        num_tokens = sc.max_num_batched_tokens
        num_seqs = max(min(sc.max_num_seqs, num_tokens), -(-num_tokens // self.max_model_len))
        q_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        q_lens[: num_tokens % num_seqs] += 1
        cu_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        positions = np.arange(num_tokens) - np.repeat(cu_q[:-1], q_lens)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        if self.attn_backend.uses_varlen_metadata:
            null_table = np.zeros((num_seqs, -(-int(q_lens.max()) // self.block_size)), dtype=np.int64)
            metadata = AttentionMetadata(
                slot_mapping=slots, num_decode_tokens=0, prefills=[],
                varlen=self._varlen_metadata(q_lens, cu_q, q_lens, null_table),
            )
        else:
            prefills = [
                PrefillSeq(int(cu_q[i]), int(cu_q[i + 1]), int(q_lens[i]), None, None) for i in range(num_seqs)
            ]
            metadata = AttentionMetadata(
                slot_mapping=slots, num_decode_tokens=0, prefills=prefills, has_negative_slots=True
            )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        hidden = self._forward(input_ids, torch.from_numpy(positions), metadata)
        if hidden is None or self.pooler is not None:
            return
        last_rows = self._to_device(torch.from_numpy(cu_q[1:] - 1))
        logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        if logits is None:
            return
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=self.config.max_logprobs)
        states = [RequestSamplingState(params) for _ in range(num_seqs)]
        self.sampler(logits, build_sampling_metadata(states, logits.shape[-1]))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensors to the device; through pinned memory without waiting,
        so input uploads do not stall the stream."""
        return t if self.on_cpu else t.pin_memory().to(self.device, non_blocking=True)

    def shutdown(self) -> None:
        for ext in self.extensions:
            ext.shutdown()

    # ---- one step ----------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove(new.req_id)  # resumed after preemption: start over
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
                # A resumed request must continue its random stream where it left off.
                if new.output_token_ids:
                    self.sampler.advance_generator(
                        generator, len(new.output_token_ids), self.model_config.vocab_size
                    )
            batch.add(
                new.req_id,
                new.prompt_token_ids,
                new.output_token_ids,
                params,
                new.block_ids,
                new.num_computed_tokens,
                generator,
                new.pooling_params,
            )
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = batch.requests[req_id]
            batch.append_blocks(state, block_ids)
            state.num_computed_tokens = num_computed
        if not self.parallel.is_driver:
            # Tokens the driver sampled since this request was last scheduled.
            for req_id, tokens in zip(cached.req_ids, cached.new_token_ids):
                state = batch.requests[req_id]
                for token in tokens:
                    batch.append_token(state, token)
        # Drafts are fed after the last token (not appended: most are rejected).
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            state = batch.requests[req_id]
            batch.token_ids[state.row, state.num_tokens : state.num_tokens + len(drafts)] = drafts

    def _plan(self, so: SchedulerOutput) -> _StepPlan:
        requests = self.input_batch.requests
        decodes: list[CachedRequestState] = []
        prefills: list[CachedRequestState] = []
        # Drafts attend like decodes (each to the positions up to its own),
        # so the decode kernel serves them without gathering the context; in
        # batch-invariant mode every token does, so that a token's attention
        # is the same sum whichever chunk or batch it comes in, unless the C
        # prefill kernel serves the prefills: it sums each token as the
        # decode kernel does.
        verify = so.scheduled_spec_decode_tokens if not self.attn_backend.uses_varlen_metadata else {}
        all_as_decodes = self.deterministic and not self.use_c_prefill
        for req_id, n in so.num_scheduled_tokens.items():
            as_decode = n == 1 or req_id in verify or all_as_decodes
            (decodes if as_decode else prefills).append(requests[req_id])
        states = decodes + prefills
        q_lens = np.fromiter((so.num_scheduled_tokens[s.req_id] for s in states), np.int64, len(states))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        cu_q = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        return _StepPlan(states, q_lens, starts, cu_q, len(decodes))

    def _flat_inputs(self, plan: _StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(batch rows per request, then per token: ids, positions, cache slots)."""
        batch = self.input_batch
        bs = self.block_size
        rows = np.fromiter((s.row for s in plan.states), np.int64, len(plan.states))
        total = int(plan.cu_q[-1])
        token_rows = np.repeat(rows, plan.q_lens)
        positions = np.repeat(plan.starts - plan.cu_q[:-1], plan.q_lens) + np.arange(total)
        input_ids = batch.token_ids[token_rows, positions]
        slots = batch.block_table[token_rows, positions // bs] * bs + positions % bs
        return rows, input_ids, positions, slots

    def _prepare_inputs(self, plan: _StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        rows, input_ids, positions, slots = self._flat_inputs(plan)
        if self.attn_backend.uses_varlen_metadata:
            seq_lens = plan.starts + plan.q_lens
            width = -(-int(seq_lens.max()) // self.block_size)
            metadata = AttentionMetadata(
                slot_mapping=torch.from_numpy(slots),
                num_decode_tokens=plan.num_decodes,
                prefills=[],
                varlen=self._varlen_metadata(
                    plan.q_lens, plan.cu_q, seq_lens, self.input_batch.block_table[rows, :width]
                ),
            )
        else:
            metadata = self._torch_metadata(plan, rows, positions, slots)
        return torch.from_numpy(input_ids), torch.from_numpy(positions), metadata

    @staticmethod
    def _varlen_metadata(
        q_lens: np.ndarray, cu_q: np.ndarray, seq_lens: np.ndarray, block_table: np.ndarray
    ) -> VarlenMetadata:
        """Host tensors (`_forward` moves them); `block_table` rows in batch order."""
        seq_start_loc = np.zeros(len(seq_lens) + 1, dtype=np.int32)
        np.cumsum(seq_lens, out=seq_start_loc[1:])
        return VarlenMetadata(
            query_start_loc=torch.from_numpy(cu_q.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            seq_start_loc=torch.from_numpy(seq_start_loc),
            block_table=torch.from_numpy(block_table.astype(np.int32)),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )

    def _torch_metadata(
        self, plan: _StepPlan, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray
    ) -> AttentionMetadata:
        batch = self.input_batch
        bs = self.block_size
        nd = plan.num_decodes
        nd_tokens = int(plan.cu_q[nd])
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots), num_decode_tokens=nd_tokens, prefills=[]
        )
        # Per decode row: its request's block-table row and context length.
        if nd_tokens == nd:
            seq_rows, seq_lens = rows[:nd], plan.starts[:nd] + 1
        else:
            seq_rows, seq_lens = np.repeat(rows[:nd], plan.q_lens[:nd]), positions[:nd_tokens] + 1
        if nd and self.use_c_decode:
            metadata.block_tables = self.block_table_tensor
            metadata.decode_seq_rows = torch.from_numpy(seq_rows)
            metadata.decode_ctx_lens = torch.from_numpy(seq_lens)
        elif nd:
            pos = np.arange(int(seq_lens.max()))
            kv_index = batch.block_table[seq_rows[:, None], pos[None, :] // bs] * bs + pos % bs
            metadata.decode_kv_index = torch.from_numpy(kv_index)
            metadata.decode_mask = torch.from_numpy(pos[None, :] < seq_lens[:, None])[:, None, None, :]
        if self.use_c_prefill and nd < len(plan.states):
            metadata.block_tables = self.block_table_tensor
            metadata.prefill_seq_rows = torch.from_numpy(np.repeat(rows[nd:], plan.q_lens[nd:]))
            metadata.prefill_ctx_lens = torch.from_numpy(positions[nd_tokens:] + 1)
            return metadata
        for i in range(nd, len(plan.states)):
            start, q_len = int(plan.starts[i]), int(plan.q_lens[i])
            ctx = start + q_len
            block_ids = mask = None
            # Keys from the first query's window on, whole blocks: those before may be released.
            first = 0 if self.kv_window is None else max(start - self.kv_window + 1, 0) // bs
            if start > 0:
                block_ids = torch.from_numpy(batch.block_table[rows[i], first : -(-ctx // bs)].copy())
                pos = np.arange(first * bs, ctx)
                mask = torch.from_numpy(pos[None, :] <= (start + np.arange(q_len))[:, None])
            metadata.prefills.append(
                PrefillSeq(int(plan.cu_q[i]), int(plan.cu_q[i + 1]), ctx - first * bs, block_ids, mask)
            )
        return metadata

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """The persistent batch follows `so`, the extensions begin the step
        (KV copies to and from a second tier among them), then the step."""
        self._update_states(so)
        begin = BeginStepContext(so)
        for ext in self.extensions:
            ext.begin_step(begin)
        output = self._execute_model(so)
        output.kv_load_failures = begin.kv_load_failures
        return output

    def _execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], None, {})
        plan = self._plan(so)
        # Sample only for requests whose scheduled tokens reach their end;
        # the others are mid-way through a chunked prefill.
        ends = plan.starts + plan.q_lens
        sample_idx = [i for i, s in enumerate(plan.states) if ends[i] >= s.num_tokens]
        # Requests with drafts are verified (every scheduled position scored) instead.
        drafts = so.scheduled_spec_decode_tokens
        verify_idx: list[int] = []
        if drafts:
            verify_idx = [i for i in sample_idx if plan.states[i].req_id in drafts]
            sample_idx = [i for i in sample_idx if plan.states[i].req_id not in drafts]
        sampled_states = [plan.states[i] for i in sample_idx]
        prepare = PrepareInputsContext(plan.states, plan.q_lens, sampled_states)
        for ext in self.extensions:
            ext.prepare_inputs(prepare)
        hidden = self._replay_decode(plan) if self.cuda_graphs is not None else None
        if hidden is None:
            input_ids, positions, metadata = self._prepare_inputs(plan)
            hidden = self._forward(input_ids, positions, metadata)
        if hidden is None:
            return ModelRunnerOutput([], [], None, {})
        if self.pooler is not None:
            if not self.parallel.is_driver:
                return ModelRunnerOutput([], [], None, {})
            pooled = self.pooler.pool(plan.states, plan.starts, plan.q_lens, plan.cu_q, hidden)
            return ModelRunnerOutput([], [], None, {}, pooled)

        prompt_logprobs: dict[str, LogprobsLists] = {}
        for i, state in enumerate(plan.states):
            if state.wants_prompt_logprobs and plan.starts[i] < len(state.prompt_token_ids):
                lp = self._prompt_logprobs(state, plan, i, hidden)
                if lp is not None:
                    prompt_logprobs[state.req_id] = lp

        if not sample_idx and not verify_idx:
            return ModelRunnerOutput([], [], None, prompt_logprobs)
        rows = plan.cu_q[1:][sample_idx] - 1
        if verify_idx:
            rows = np.concatenate([rows, *(np.arange(plan.cu_q[i], plan.cu_q[i + 1]) for i in verify_idx)])
        logits = self.model.compute_logits(hidden.index_select(0, self._to_device(torch.from_numpy(rows))))
        if logits is None:  # a TP rank that only contributed its vocabulary shard
            if self.shares_tokens:
                self._append_shared_tokens(plan.states)
            return ModelRunnerOutput([], [], None, {})
        if not self.shares_tokens:
            return self._sample_step(plan, sampled_states, verify_idx, drafts, logits, prompt_logprobs)
        before = [len(s.output_token_ids) for s in plan.states]
        try:
            output = self._sample_step(plan, sampled_states, verify_idx, drafts, logits, prompt_logprobs)
        except BaseException:
            # The group waits for this step's tokens: tell it there are none.
            tp_share_new_tokens([-1] * len(before), [], len(before), self.device, self.parallel)
            raise
        counts = [len(s.output_token_ids) - b for s, b in zip(plan.states, before)]
        tokens = [t for s, b in zip(plan.states, before) for t in s.output_token_ids[b:]]
        tp_share_new_tokens(counts, tokens, len(before), self.device, self.parallel)
        return output

    def _sample_step(
        self,
        plan: _StepPlan,
        sampled_states: list[CachedRequestState],
        verify_idx: list[int],
        drafts: dict[str, list[int]],
        logits: torch.Tensor,
        prompt_logprobs: dict[str, LogprobsLists],
    ) -> ModelRunnerOutput:
        """The driver's end of a step: the extensions' logits hooks, sampling
        (tokens appended to the batch) and the extensions' after-sample hooks."""
        verify_states = [plan.states[i] for i in verify_idx]
        logits_ctx = LogitsContext(logits, sampled_states, verify_states, drafts)
        for ext in self.extensions:
            ext.before_sample(logits_ctx)
        token_ids: list[int] = []
        logprobs = None
        if sampled_states:
            token_ids, logprobs = self._sample(logits_ctx.sampling_logits, sampled_states)
        batch = self.input_batch
        sample = SampleContext(
            sampled_states, token_ids, verify_states, logits_ctx.verify_logits, drafts,
            batch.token_ids, self.forward_positions, batch.append_token,
        )
        for ext in self.extensions:
            ext.after_sample(sample)
        return ModelRunnerOutput(
            [s.req_id for s in sampled_states], token_ids, logprobs, prompt_logprobs, spec_decode=sample.spec_decode
        )

    def _append_shared_tokens(self, states: list[CachedRequestState]) -> None:
        """A non-driver TP rank's batch takes the tokens the driver appended
        this step, so both build the next step's inputs alike."""
        counts, tokens = tp_share_new_tokens(None, None, len(states), self.device, self.parallel)
        if counts and counts[0] < 0:
            return  # the driver's step failed: it appended nothing either
        at = 0
        for state, count in zip(states, counts):
            for token in tokens[at : at + count]:
                self.input_batch.append_token(state, token)
            at += count

    def _sample(
        self, logits: torch.Tensor, sampled_states: list[CachedRequestState]
    ) -> tuple[list[int], LogprobsLists | None]:
        """One token per row, appended to the batch; with logprob rows when asked."""
        out = self.sampler(logits, build_sampling_metadata(sampled_states, logits.shape[-1]))
        # The step's one unavoidable sync: ids stay on the device until here.
        token_ids: list[int] = out.sampled_token_ids.tolist()
        for state, token in zip(sampled_states, token_ids):
            self.input_batch.append_token(state, token)
        return token_ids, out.logprobs.tolists() if out.logprobs is not None else None

    def forward_positions(
        self, model: CausalLM, states: list[CachedRequestState], starts: np.ndarray, q_lens: np.ndarray
    ) -> torch.Tensor:
        """Hidden states of `model` (a draft model with its own KV caches,
        run on this rank alone) at the last of each request's positions
        [start, start + q_len), whose tokens are in the persistent batch;
        rows in the order of `states`."""
        order = np.argsort(q_lens != 1, kind="stable")  # decodes first, as _plan does
        q_sorted = q_lens[order]
        cu_q = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(q_sorted, out=cu_q[1:])
        plan = _StepPlan([states[i] for i in order], q_sorted, starts[order], cu_q, int((q_sorted == 1).sum()))
        input_ids, positions, metadata = self._prepare_inputs(plan)
        if not self.on_cpu:
            metadata = metadata.map_tensors(self._to_device)
        hidden = model(self._to_device(input_ids), self._to_device(positions), metadata, None)
        last = np.empty(len(states), dtype=np.int64)
        last[order] = cu_q[1:] - 1
        return hidden.index_select(0, self._to_device(torch.from_numpy(last)))

    def _replay_decode(self, plan: _StepPlan) -> torch.Tensor | None:
        """Hidden states of a pure-decode step by CUDA graph replay; None if
        the step has a prefill or more decodes than the largest graph."""
        assert self.cuda_graphs is not None
        n = len(plan.states)
        if plan.num_decodes != n or not self.cuda_graphs.fits(n):
            return None
        rows, input_ids, positions, slots = self._flat_inputs(plan)
        return self.cuda_graphs.run(
            input_ids, positions, slots, plan.starts + 1, self.input_batch.block_table[rows]
        )

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """This stage's share of the forward (inputs and metadata on the
        host); the last stage's hidden states, or None on earlier stages
        (which pass theirs on)."""
        assert self.model is not None
        ctx = self.parallel
        intermediate = None
        if not ctx.is_first_stage:
            intermediate = recv_from_prev_stage(
                input_ids.shape[0], self.model_config.hf_config["hidden_size"], self.dtype, self.device, ctx
            )
        if not self.on_cpu:
            metadata = metadata.map_tensors(self._to_device)
        out = self.model(self._to_device(input_ids), self._to_device(positions), metadata, intermediate)
        if ctx.is_last_stage:
            return out
        send_to_next_stage(out[0], out[1], ctx)
        return None

    def _prompt_logprobs(
        self, state: CachedRequestState, plan: _StepPlan, i: int, hidden: torch.Tensor
    ) -> LogprobsLists | None:
        """Rows for prompt positions predicted in this chunk: hidden state of
        position j scores prompt token j + 1."""
        start, q_len = int(plan.starts[i]), int(plan.q_lens[i])
        n_prompt = len(state.prompt_token_ids)
        last = min(start + q_len, n_prompt - 1)
        base = int(plan.cu_q[i])
        rows = hidden[base : base + (last - start)]
        targets = state.prompt_token_ids[start + 1 : last + 1]
        logits = self.model.compute_logits(rows)
        if logits is None:
            return None
        return compute_prompt_logprobs(logits, targets, state.sampling_params.prompt_logprobs or 0)
