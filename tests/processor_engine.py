"""What `OpenAIServing` asks an `EngineClient` about the model, answered by
a real `Processor`, for test engines that script their outputs: names,
tokenization and chat rendering are the real ones, so are errors and
prompt ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rayvllm.frontend.processor import Processor


class ProcessorEngine:
    def __init__(self, processor: Processor, served_model_name: str) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.served_model_name = served_model_name
        self.model_path = processor.model_config.model
        self.max_model_len = processor.max_model_len
        self.vocab_size = processor.vocab_size

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.tokenize(text, add_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        return self.processor.render_chat(messages, **options)
