"""`LoRAConfig`: the engine's LoRA knobs, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from rayvllm.config.fields import config_field
from rayvllm.messages.errors import InvalidParameterError

# The Llama family's projections an adapter may target (HF module names).
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What stands for q/k/v and gate/up in a model whose checkpoint fuses them
# (these model types'), so that its adapters target them whole.
FUSED_TARGET_MODULES = ("qkv_proj", "gate_up_proj")
FUSED_MODEL_TYPES = ("phi3",)


@dataclass
class LoRAConfig:
    """Invariants: `max_loras` adapters occupy the batch's slots at once (a
    step never mixes more); `max_cpu_loras >= max_loras` adapters stay
    loaded in host memory, ready to copy into a slot; no adapter's rank
    exceeds `max_lora_rank`."""

    max_loras: int = config_field("adapters one step's batch may use at once (each holds a slot)", 1)
    max_lora_rank: int = config_field("the highest rank of an adapter the engine takes", 16)
    max_cpu_loras: int | None = config_field(
        "adapters kept loaded in host memory, ready to copy into a slot; unset: max_loras", None
    )

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise InvalidParameterError("max_loras", f"must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise InvalidParameterError("max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise InvalidParameterError(
                "max_cpu_loras", f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
