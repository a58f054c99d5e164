"""Public output types, with vLLM's names and meanings.

These are what `LLM.generate`, the async engine's streams and the OpenAI
server consume. They carry text and token ids already detokenized by the
`OutputProcessor`; nothing here touches the tokenizer or the engine core.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SampleLogprobs",
]


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request carries (vLLM's values).

    CUMULATIVE: everything generated so far, every step.
    DELTA: only what is new since the previous output of the request.
    FINAL_ONLY: one output, when the request finishes (offline `LLM.generate`).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    """Log probability of one token at one position.

    `rank` is the token's 1-based rank in the distribution it was drawn from
    (1 = most likely); `decoded_token` is the token decoded on its own, which
    for a byte token of a multi-byte character is U+FFFD, as in vLLM.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob. The chosen token is
# always a key; the others are the top-k the request asked for.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sequence generated for a request (one of its `n`).

    Invariants: `finish_reason` is None while the sequence is running and one
    of "stop", "length", "abort" once it is done; `stop_reason` is the stop
    string or stop token id that ended it, None for EOS, length or abort.
    `cumulative_logprob` is None unless the request asked for logprobs. In a
    DELTA stream `text`, `token_ids` and `logprobs` hold only what is new,
    while `cumulative_logprob` is still the running total.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (`time.time()` seconds) of one request.

    Invariant: arrival_time <= first_token_time <= last_token_time <=
    finished_time whenever they are set. `first_scheduled_time` is when the
    scheduler first ran the request (the engine core reports it with the
    first token), so queue time = first_scheduled_time - arrival_time.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One update for one user request (all its `n` sequences).

    Invariants: `outputs` is sorted by `CompletionOutput.index`; `finished` is
    True exactly once per request, on its last output, and then every
    sequence of the request is finished. `prompt` is None when the request
    came as token ids. `num_cached_tokens` counts prompt tokens served from
    the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None

    def merged_with(self, later: RequestOutput) -> RequestOutput:
        """This DELTA output followed by `later` (the request's next) as one
        delta: per sequence the new text, ids and logprobs joined, the
        running totals and finish from `later`. A new object; neither input
        changes."""
        merged = {o.index: dataclasses.replace(o, token_ids=list(o.token_ids)) for o in self.outputs}
        for o in later.outputs:
            earlier = merged.get(o.index)
            if earlier is None:
                merged[o.index] = o
                continue
            earlier.text += o.text
            earlier.token_ids += o.token_ids
            if o.logprobs is not None:
                earlier.logprobs = (earlier.logprobs or []) + o.logprobs
            earlier.cumulative_logprob = o.cumulative_logprob
            earlier.finish_reason, earlier.stop_reason = o.finish_reason, o.stop_reason
        prompt_logprobs = self.prompt_logprobs
        if later.prompt_logprobs is not None:
            prompt_logprobs = (prompt_logprobs or []) + later.prompt_logprobs
        return dataclasses.replace(
            later, prompt_logprobs=prompt_logprobs, outputs=[merged[i] for i in sorted(merged)],
            num_cached_tokens=later.num_cached_tokens if later.num_cached_tokens is not None else self.num_cached_tokens,
        )


@dataclass
class PoolingOutput:
    """The pooled vector of one prompt (float32, on the host)."""

    data: "torch.Tensor"


@dataclass
class PoolingRequestOutput:
    """The one output of a pooling request: finished when it arrives (a
    pooling request has no partial outputs). `prompt_token_ids` is the
    prompt that was pooled; `num_cached_tokens` counts prefix-cache hits."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """vLLM's embedding view of a pooled vector."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "EmbeddingOutput":
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt: `outputs.embedding` is the vector."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs), output.prompt_token_ids,
                   output.finished)
