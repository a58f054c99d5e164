"""Runs one scheduler step on one device: inputs, forward, sampling.

The runner mirrors the scheduler's view of each request in an `InputBatch`
(full data arrives once, then deltas) and appends the tokens it samples
itself, so a decode step needs nothing from the scheduler but block ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rayvllm.config import EngineConfig
from rayvllm.core.sched.output import SchedulerOutput
from rayvllm.distributed.parallel_state import (
    ParallelContext,
    recv_from_prev_stage,
    send_to_next_stage,
)
from rayvllm.kernels import cpu_attention
from rayvllm.kernels.metadata import AttentionMetadata, PrefillSeq
from rayvllm.models.loader import load_model
from rayvllm.worker.input_batch import CachedRequestState, InputBatch
from rayvllm.worker.outputs import LogprobsLists, ModelRunnerOutput
from rayvllm.worker.prompt_logprobs import compute_prompt_logprobs
from rayvllm.worker.sampler import Sampler
from rayvllm.worker.sampling_metadata import build_sampling_metadata

_DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass
class _StepPlan:
    """Flat-batch layout of one step: requests in batch order (decodes first)."""

    states: list[CachedRequestState]
    q_lens: np.ndarray
    starts: np.ndarray
    cu_q: np.ndarray
    num_decodes: int


class ModelRunner:
    """One rank's runner. Under tensor/pipeline parallelism every rank of a
    group runs `execute_model` on the same SchedulerOutput; only the driver
    rank (`ParallelContext.is_driver`) samples and returns tokens, the others
    return an empty output and append the tokens the scheduler sends back."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.device = torch.device(config.device)
        self.dtype = self.model_config.dtype
        self.block_size = self.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size
        )
        self.sampler = Sampler()
        # The persistent block table, shared (not copied) with the decode kernel.
        self.block_table_tensor = torch.from_numpy(self.input_batch.block_table)
        self.use_c_decode = (
            self.device.type == "cpu"
            and self.dtype == torch.float32
            and cpu_attention.supports(self.model_config.head_dim, self.block_size)
        )
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- setup -------------------------------------------------------------------

    def load_model(self) -> None:
        torch.manual_seed(self.model_config.seed)
        self.model = load_model(
            self.model_config.model, self.model_config.hf_config, self.dtype, str(self.device), self.parallel
        )

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block across this rank's layers and KV heads."""
        assert self.model is not None
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
            for layer in self.model.attention_layers()
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
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = int(total * cc.gpu_memory_utilization) - used_by_others
        else:
            budget = _DEFAULT_CPU_KV_BYTES
        max_useful = self.config.scheduler_config.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        num_blocks = min(budget // self.kv_bytes_per_block(), max_useful)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {self.kv_bytes_per_block()} bytes; "
                "raise kv_cache_memory_bytes / gpu_memory_utilization"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Per layer: keys `[blocks, kv_heads, head_size, block_size]`, values
        `[blocks, block_size, kv_heads, head_size]` (see kernels/reference.py)."""
        assert self.model is not None
        self.kv_caches = []
        # Zeroed, not empty: padded decode rows read unused slots, and NaN
        # garbage there would survive the mask as 0 * NaN.
        for layer in self.model.attention_layers():
            k_shape = (num_blocks, layer.num_kv_heads, layer.head_dim, self.block_size)
            v_shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            k = torch.zeros(k_shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(v_shape, dtype=self.dtype, device=self.device)
            layer.bind_kv_cache(k, v)
            self.kv_caches.append((k, v))

    # ---- one step ----------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
        for req_id in so.preempted_req_ids:
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

    def _plan(self, so: SchedulerOutput) -> _StepPlan:
        requests = self.input_batch.requests
        decodes: list[CachedRequestState] = []
        prefills: list[CachedRequestState] = []
        for req_id, n in so.num_scheduled_tokens.items():
            (decodes if n == 1 else prefills).append(requests[req_id])
        states = decodes + prefills
        q_lens = np.fromiter((so.num_scheduled_tokens[s.req_id] for s in states), np.int64, len(states))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        cu_q = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        return _StepPlan(states, q_lens, starts, cu_q, len(decodes))

    def _prepare_inputs(self, plan: _StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        batch = self.input_batch
        bs = self.block_size
        rows = np.fromiter((s.row for s in plan.states), np.int64, len(plan.states))
        total = int(plan.cu_q[-1])
        token_rows = np.repeat(rows, plan.q_lens)
        positions = np.repeat(plan.starts - plan.cu_q[:-1], plan.q_lens) + np.arange(total)
        input_ids = batch.token_ids[token_rows, positions]
        slots = batch.block_table[token_rows, positions // bs] * bs + positions % bs

        nd = plan.num_decodes
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots), num_decode_tokens=nd, prefills=[]
        )
        if nd and self.use_c_decode:
            metadata.block_tables = self.block_table_tensor
            metadata.decode_seq_rows = torch.from_numpy(rows[:nd])
            metadata.decode_ctx_lens = torch.from_numpy(plan.starts[:nd] + 1)
        elif nd:
            seq_lens = plan.starts[:nd] + 1
            pos = np.arange(int(seq_lens.max()))
            kv_index = batch.block_table[rows[:nd, None], pos[None, :] // bs] * bs + pos % bs
            metadata.decode_kv_index = torch.from_numpy(kv_index)
            metadata.decode_mask = torch.from_numpy(pos[None, :] < seq_lens[:, None])[:, None, None, :]
        for i in range(nd, len(plan.states)):
            start, q_len = int(plan.starts[i]), int(plan.q_lens[i])
            ctx = start + q_len
            block_ids = mask = None
            if start > 0:
                block_ids = torch.from_numpy(batch.block_table[rows[i], : -(-ctx // bs)].copy())
                pos = np.arange(ctx)
                mask = torch.from_numpy(pos[None, :] <= (start + np.arange(q_len))[:, None])
            metadata.prefills.append(
                PrefillSeq(int(plan.cu_q[i]), int(plan.cu_q[i + 1]), ctx, block_ids, mask)
            )
        return torch.from_numpy(input_ids), torch.from_numpy(positions), metadata

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], [], None, {})
        plan = self._plan(so)
        input_ids, positions, metadata = self._prepare_inputs(plan)
        hidden = self._forward(input_ids, positions, metadata)
        if hidden is None:
            return ModelRunnerOutput([], [], None, {})

        # Sample only for requests whose scheduled tokens reach their end;
        # the others are mid-way through a chunked prefill.
        ends = plan.starts + plan.q_lens
        sample_idx = [
            i for i, s in enumerate(plan.states) if ends[i] >= s.num_tokens
        ]
        prompt_logprobs: dict[str, LogprobsLists] = {}
        for i, state in enumerate(plan.states):
            if state.wants_prompt_logprobs and plan.starts[i] < len(state.prompt_token_ids):
                lp = self._prompt_logprobs(state, plan, i, hidden)
                if lp is not None:
                    prompt_logprobs[state.req_id] = lp

        if not sample_idx:
            return ModelRunnerOutput([], [], None, prompt_logprobs)
        sampled_states = [plan.states[i] for i in sample_idx]
        last_rows = torch.from_numpy(plan.cu_q[1:][sample_idx] - 1)
        logits = self.model.compute_logits(hidden.index_select(0, last_rows.to(self.device)))
        if logits is None:  # a TP rank that only contributed its vocabulary shard
            return ModelRunnerOutput([], [], None, {})
        metadata_s = build_sampling_metadata(sampled_states, logits.shape[-1])
        out = self.sampler(logits, metadata_s)
        token_ids: list[int] = out.sampled_token_ids.tolist()
        for state, token in zip(sampled_states, token_ids):
            self.input_batch.append_token(state, token)
        logprobs = out.logprobs.tolists() if out.logprobs is not None else None
        return ModelRunnerOutput(
            [s.req_id for s in sampled_states], token_ids, logprobs, prompt_logprobs
        )

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """This stage's share of the forward; the last stage's hidden states,
        or None on earlier stages (which pass theirs on)."""
        assert self.model is not None
        ctx = self.parallel
        intermediate = None
        if not ctx.is_first_stage:
            intermediate = recv_from_prev_stage(
                input_ids.shape[0], self.model_config.hf_config["hidden_size"], self.dtype, self.device, ctx
            )
        out = self.model(input_ids.to(self.device), positions.to(self.device), metadata, intermediate)
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
