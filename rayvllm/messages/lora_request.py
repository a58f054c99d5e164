"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from rayvllm.messages.errors import InvalidParameterError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (adapter_config.json plus
    adapter_model.safetensors) under a name and an id.

    Invariant: `lora_int_id >= 1` is the adapter's identity in the engine
    (slots, host cache); requests with the same id share one loaded copy,
    so one id must always name the same adapter, as in vLLM.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidParameterError("lora_request.lora_name", "must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidParameterError("lora_request.lora_int_id", f"must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidParameterError("lora_request.lora_path", "must name an adapter directory")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of `lora_int_id`."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
