"""The front end's check of a request's `lora_request`, before the core
sees it: LoRA enabled, the adapter runnable on this model, one id naming
one adapter. An adapter directory is read once per (id, path)."""

from __future__ import annotations

from rayvllm.config.lora import LoRAConfig
from rayvllm.lora.peft_adapter import check_adapter
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.lora_request import LoRARequest


class LoRAChecker:
    """Invariant: `paths[id]` is the one adapter directory id `id` has named."""

    def __init__(self, lora_config: LoRAConfig | None, hf_config: dict) -> None:
        self.lora_config = lora_config
        self.hf_config = hf_config
        self.paths: dict[int, str] = {}

    def check(self, lora_request: object) -> LoRARequest | None:
        """`lora_request` if the engine can run it (None passes); else
        InvalidParameterError naming it."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise InvalidParameterError(
                "lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}"
            )
        if self.lora_config is None:
            raise InvalidParameterError("lora_request", "LoRA is not enabled; start the engine with enable_lora=True")
        known = self.paths.get(lora_request.lora_int_id)
        if known == lora_request.lora_path:
            return lora_request
        if known is not None:
            raise InvalidParameterError(
                "lora_request.lora_int_id",
                f"{lora_request.lora_int_id} already names the adapter at {known!r}; give another adapter another id",
            )
        check_adapter(lora_request, self.lora_config, self.hf_config)
        self.paths[lora_request.lora_int_id] = lora_request.lora_path
        return lora_request
