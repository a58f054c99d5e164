"""The scheduler's side of LoRA: which adapter occupies which of the
`max_loras` batch slots.

A slot is pinned while any running request uses its adapter; an adapter
that no running request uses stays resident (a later request for it costs
no load) until a new adapter needs its slot, least recently used first.
So a step never holds more than `max_loras` distinct adapters, and a
running request's weights are never replaced under it.
"""

from __future__ import annotations

from collections import OrderedDict

from rayvllm.core.request import Request


class LoRASlots:
    """The scheduler's `LoRASlotTable` (core/sched/plugins.py), built and
    injected by the engine.

    Invariants: `resident` maps adapter id -> slot, least recently used
    first, over distinct slots; `refs[id]` counts the running requests in
    `held` that use adapter `id`; a slot whose adapter has refs is never
    reassigned."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.resident: OrderedDict[int, int] = OrderedDict()
        self.refs: dict[int, int] = {}
        self.held: dict[str, int] = {}

    def can_admit(self, request: Request) -> bool:
        """Whether `acquire` would find `request` a slot now."""
        lora = request.lora_request
        if lora is None or lora.lora_int_id in self.resident or len(self.resident) < self.max_loras:
            return True
        return any(not self.refs.get(lora_id) for lora_id in self.resident)

    def acquire(self, request: Request) -> int:
        """The slot of `request`'s adapter (-1 for the base model), loading
        it over the least recently used idle adapter if need be; call only
        after `can_admit` said yes."""
        lora = request.lora_request
        if lora is None:
            return -1
        lora_id = lora.lora_int_id
        slot = self.resident.pop(lora_id, None)
        if slot is None:
            if len(self.resident) < self.max_loras:
                # Slots fill in order and are reassigned, never emptied.
                slot = len(self.resident)
            else:
                victim = next(i for i in self.resident if not self.refs.get(i))
                slot = self.resident.pop(victim)
        self.resident[lora_id] = slot
        self.refs[lora_id] = self.refs.get(lora_id, 0) + 1
        self.held[request.request_id] = lora_id
        return slot

    def release(self, request: Request) -> None:
        """`request` stopped running (finished, aborted or preempted)."""
        lora_id = self.held.pop(request.request_id, None)
        if lora_id is not None:
            self.refs[lora_id] -= 1
