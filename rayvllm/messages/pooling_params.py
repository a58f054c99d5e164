"""`PoolingParams`: what a pooling (embedding) request asks for, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """How to pool one request's prompt into a vector.

    `normalize`: L2-normalise the vector; None takes the model's pooler
    config (on by default for embeddings, as in vLLM). `dimensions`:
    vLLM's Matryoshka truncation, which no model served here supports, so
    the Processor refuses anything but None. `pooling_type` is not the
    caller's to set: the Processor copies the engine's one pooling type
    into the private copy it hands the core (the KV cache manager reads it:
    mean pooling needs every prompt position computed).
    """

    normalize: bool | None = None
    dimensions: int | None = None
    pooling_type: str | None = None
