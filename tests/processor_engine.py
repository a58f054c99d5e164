"""The model-facing half of `EngineClient` over a real `Processor`, for
test engines that script their outputs: names, checks, tokenization and
chat rendering are the real ones, so errors and prompt ids are too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rayvllm.lora.request import LoRARequest
from rayvllm.pooling_params import PoolingParams
from rayvllm.processor import Processor
from rayvllm.sampling_params import SamplingParams


class ProcessorEngine:
    def __init__(self, processor: Processor, served_model_name: str = "demo") -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.served_model_name = served_model_name
        self.model_path = processor.model_config.model
        self.max_model_len = processor.max_model_len
        self.vocab_size = processor.vocab_size

    def check_runner(self, params: SamplingParams | PoolingParams) -> None:
        self.processor.check_runner(params)

    def check_lora(self, lora_request: LoRARequest) -> None:
        self.processor.lora.check(lora_request)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.tokenize(text, add_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        return self.processor.render_chat(messages, **options)
