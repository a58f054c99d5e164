"""What the engine core emits per request per step, for the OutputProcessor."""

from __future__ import annotations

from dataclasses import dataclass

from rayvllm.request import FinishReason
from rayvllm.worker.outputs import LogprobsLists


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step.

    `finish_reason` is set on the last output of a request; `stop_reason` is
    the stop token id that ended it (a stop *string* is found later, by the
    OutputProcessor, which then asks the core to abort the request).
    `new_prompt_logprobs` carries prompt positions computed this step; the
    first prompt token has none, as in vLLM.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
