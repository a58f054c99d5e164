"""One rank's adapters: the model's projections wrapped with LoRA slots,
a host cache of loaded adapters, and each step's token-to-slot mask.

The scheduler decides which adapter occupies which slot (`LoRASlots`) and
never reassigns a slot while a request runs with it; this side only
copies an adapter into the slot a new request names, when the slot holds
another one. Every rank of a group runs the same steps and loads its own
shard of each adapter, sliced as the base weights are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from rayvllm.config.lora import LoRAConfig
from rayvllm.lora.layers import LoRALinear, LoRAStep
from rayvllm.lora.peft_adapter import PeftAdapter, load_adapter
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.models.interface import CausalLM

# HF projection -> (our fused projection, its slice index).
_TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
    # A fused checkpoint's projections (Phi-3), each adapted whole in one slice.
    "qkv_proj": ("self_attn.qkv_proj", 0),
    "gate_up_proj": ("mlp.gate_up_proj", 0),
}
_SLICES = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}


class LoRAModelManager:
    """Invariants: `slot_ids[s]` is the id of the adapter whose weights
    slot `s` holds (None: empty); `host_cache` holds at most
    `max_cpu_loras` adapters, least recently used first."""

    def __init__(
        self, model: CausalLM, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
        to_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """`to_device`: the runner's upload of a step's host tensors."""
        self.model = model
        # A checkpoint projection's shard of the layer stacking it (q_proj -> "q").
        self.shard_ids = {checkpoint: shard for _, checkpoint, shard in model.stacked_params}
        self.to_device = to_device
        self.config = config
        self.dtype = dtype
        self.device = device
        self.step = LoRAStep()
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.layers:
            wrapped: dict[str, LoRALinear] = {}
            for path, num_slices in _SLICES.items():
                owner_name, attr = path.split(".")
                owner = getattr(layer, owner_name)
                lora = LoRALinear(
                    getattr(owner, attr), num_slices, config.max_loras, config.max_lora_rank, self.step, dtype, device
                )
                setattr(owner, attr, lora)
                wrapped[path] = lora
            self.layers.append(wrapped)
        self.slot_ids: list[int | None] = [None] * config.max_loras
        self.host_cache: OrderedDict[int, PeftAdapter] = OrderedDict()
        self.req_slots: dict[str, int] = {}

    def update(self, so: SchedulerOutput) -> None:
        """Follow the step's request changes; load the adapters its new requests name."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.req_slots.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.lora_request is None:
                self.req_slots.pop(new.req_id, None)
                continue
            self.activate(new.lora_slot, new.lora_request)
            self.req_slots[new.req_id] = new.lora_slot

    def set_step(self, req_ids: Sequence[str], q_lens: np.ndarray) -> None:
        """The mask of a step that runs `q_lens[i]` tokens of `req_ids[i]`, in batch order."""
        slots = np.fromiter((self.req_slots.get(r, -1) for r in req_ids), np.int64, len(req_ids))
        if not (slots >= 0).any():
            self.step.mask = None
            return
        token_slots = torch.from_numpy(np.repeat(slots, q_lens))
        rows = (token_slots >= 0).nonzero().squeeze(1)
        mask = torch.zeros(token_slots.shape[0], self.config.max_loras, 1, dtype=self.dtype)
        mask[rows, token_slots[rows], 0] = 1
        self.step.mask = self.to_device(mask)

    def activate(self, slot: int, request: LoRARequest) -> None:
        """Copy the adapter into `slot` unless it is there already."""
        if self.slot_ids[slot] == request.lora_int_id:
            return
        adapter = self._host_adapter(request)
        start = self.model.start_layer
        for wrapped in self.layers:
            for lora in wrapped.values():
                lora.clear_slot(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            if not start <= layer < self.model.end_layer:
                continue
            path, index = _TARGETS[module]
            a, b, row_start = self._shard(layer - start, module, a, b)
            self.layers[layer - start][path].set_slice(slot, index, a, b, row_start)
        self.slot_ids[slot] = request.lora_int_id

    def _host_adapter(self, request: LoRARequest) -> PeftAdapter:
        adapter = self.host_cache.pop(request.lora_int_id, None)
        if adapter is None:
            adapter = load_adapter(request)
        self.host_cache[request.lora_int_id] = adapter
        assert self.config.max_cpu_loras is not None
        while len(self.host_cache) > self.config.max_cpu_loras:
            self.host_cache.popitem(last=False)
        return adapter

    def _shard(
        self, local_layer: int, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's share of one projection's A and B, as the base layer
        slices its weight (layers/linear.py): output rows of B (its shard of
        a column-parallel layer), input columns of A (row-parallel); and the
        output row where B's slice lands."""
        base = self.layers[local_layer][_TARGETS[module][0]].base
        row_start = 0
        if base.shards:
            # A fused projection (no shard id) takes every shard's rows; the
            # layer holds them one after another, in the checkpoint's order.
            shard = self.shard_ids.get(module)
            pieces = [base.shards[shard]] if shard is not None else list(base.shards.values())
            starts = [p.src + (p.fused if shard is None else 0) for p in pieces]
            row_start, b = pieces[0].dst, torch.cat([b[s : s + p.count] for s, p in zip(starts, pieces)])
        if base.input_cols is not None:
            a = a[:, base.input_cols[0] : base.input_cols[1]]
        return a.to(self.device, self.dtype), b.to(self.device, self.dtype), row_start
