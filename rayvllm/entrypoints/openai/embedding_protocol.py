"""POST /v1/embeddings: request and response models (OpenAI's, plus vLLM's
`add_special_tokens` and `normalize`)."""

from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from pydantic import Field

from rayvllm.entrypoints.openai.protocol import OpenAIBaseModel, with_param
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.pooling_params import PoolingParams

__all__ = ["EmbeddingRequest", "EmbeddingResponse", "EmbeddingResponseData", "EmbeddingUsage", "encode_embedding"]


class EmbeddingRequest(OpenAIBaseModel):
    """`input` is a text, a batch of texts, token ids or a batch of token-id
    lists; one embedding per item, in order."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM extensions.
    add_special_tokens: bool = True
    normalize: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(normalize=self.normalize, dimensions=self.dimensions)

    def translate_error(self, exc: InvalidParameterError) -> InvalidParameterError:
        """Processor errors about the prompt are about `input` here."""
        if exc.param in ("prompt", "prompt_token_ids"):
            return with_param(exc, "input")
        return exc


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: EmbeddingUsage


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as JSON numbers, or as base64 of little-endian float32
    (what OpenAI's client decodes with `np.frombuffer(..., dtype="float32")`)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
