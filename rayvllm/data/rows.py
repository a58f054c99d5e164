"""Ray Data rows <-> engine requests and outputs, with Ray Data LLM's
column names. Ray-free.

A row asks with `prompt` (text), `messages` (a chat) or `prompt_token_ids`,
and `sampling_params` (generate) or `pooling_params` (embed), a dict per
row; `model` names a LoRA adapter (or the base model). Rows of one Arrow
batch share one struct type for those dicts, so a key another row set
reads None here: None means "the default".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rayvllm.data.config import EngineProcessorConfig
from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.messages.structured_outputs import StructuredOutputsParams

# What a replica needs of a row; the other columns stay with the feeder.
REQUEST_COLUMNS = ("prompt", "messages", "prompt_token_ids", "sampling_params", "pooling_params", "model")
GENERATE_COLUMNS = (
    "prompt", "prompt_token_ids", "num_input_tokens", "generated_text", "generated_tokens",
    "num_generated_tokens", "finish_reason",
)
EMBED_COLUMNS = ("prompt", "prompt_token_ids", "num_input_tokens", "embeddings")


@dataclass(frozen=True)
class RowStages:
    """Which of Ray Data LLM's stages run for a row, and where its LoRA
    adapters are (EngineProcessorConfig). Tokenizing is no stage of its
    own here: the engine tokenizes text as it admits it."""

    apply_chat_template: bool = True
    chat_template: str | None = None
    detokenize: bool = True
    base_model: str | None = None
    lora_path: str | None = None

    @classmethod
    def of(cls, config: EngineProcessorConfig) -> "RowStages":
        return cls(config.apply_chat_template, config.chat_template, config.detokenize, config.model_source,
                   config.dynamic_lora_loading_path)

    def adapter_path(self, fields: Mapping[str, Any]) -> str | None:
        """The LoRA adapter a row's `model` names (Ray Data LLM's column),
        None for the base model."""
        name = fields.get("model")
        if name is None or name == self.base_model:
            return None
        return os.path.join(self.lora_path, name) if self.lora_path else str(name)


def request_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    """The part of `row` a replica reads (unset fields left out)."""
    return {k: row[k] for k in REQUEST_COLUMNS if row.get(k) is not None}


def _given(params: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (params or {}).items() if v is not None}


def sampling_params(fields: Mapping[str, Any]) -> SamplingParams:
    given = _given(fields.get("sampling_params"))
    if isinstance(given.get("structured_outputs"), Mapping):
        given["structured_outputs"] = StructuredOutputsParams(**_given(given["structured_outputs"]))
    try:
        return SamplingParams(**given)
    except TypeError as e:  # an unknown key
        raise ValueError(f"sampling_params: {e}") from e


def pooling_params(fields: Mapping[str, Any]) -> PoolingParams:
    try:
        return PoolingParams(**_given(fields.get("pooling_params")))
    except TypeError as e:
        raise ValueError(f"pooling_params: {e}") from e


def empty_columns(embed: bool) -> dict[str, Any]:
    """A failed row's output columns: the schema of a good row, empty."""
    if embed:
        return {"prompt": None, "prompt_token_ids": None, "num_input_tokens": 0, "embeddings": None}
    return {
        "prompt": None, "prompt_token_ids": None, "num_input_tokens": 0, "generated_text": "",
        "generated_tokens": [], "num_generated_tokens": 0, "finish_reason": None,
    }


def generate_columns(out: RequestOutput, prompt: str | None, stages: RowStages) -> dict[str, Any]:
    """A finished request's columns (its first sequence, as Ray Data LLM's)."""
    seq = out.outputs[0]
    return {
        "prompt": prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "num_input_tokens": len(out.prompt_token_ids),
        "generated_text": seq.text if stages.detokenize else "",
        "generated_tokens": list(seq.token_ids),
        "num_generated_tokens": len(seq.token_ids),
        "finish_reason": seq.finish_reason,
    }


def embed_columns(out: PoolingRequestOutput, prompt: str | None) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "prompt_token_ids": list(out.prompt_token_ids),
        "num_input_tokens": len(out.prompt_token_ids),
        "embeddings": out.outputs.data.float().tolist(),
    }
