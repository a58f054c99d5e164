"""Batch inference over Ray Data (docs/BATCH.md): `build_processor(EngineProcessorConfig(...))(dataset)`."""

from rayvllm.data.config import ERROR_COLUMN, EngineProcessorConfig
from rayvllm.data.processor import Processor, build_processor

__all__ = ["ERROR_COLUMN", "EngineProcessorConfig", "Processor", "build_processor"]
