"""What the scheduler asks of the features it is given (built by the engine
layer and injected, never imported here): LoRA's adapter slots and the
speculation rule. The KV tier's side is `rayvllm.core.kv_tier.KVTier`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from rayvllm.core.request import Request
from rayvllm.messages.sampling_params import SamplingParams

# Whether a request with these parameters may speculate (its next-token
# distribution must not depend on the drafts before each position).
SpeculationEligibility = Callable[[SamplingParams], bool]


class LoRASlotTable(Protocol):
    """Which adapter occupies which of the batch's LoRA slots. A running
    request's slot is never reassigned while it holds it."""

    def can_admit(self, request: Request) -> bool:
        """Whether `acquire` would find `request` a slot now."""
        ...

    def acquire(self, request: Request) -> int:
        """The slot of `request`'s adapter (-1 for the base model); call
        only after `can_admit` said yes."""
        ...

    def release(self, request: Request) -> None:
        """`request` stopped running (finished, aborted or preempted)."""
        ...
