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
    # Set on a request's first token only: when the scheduler first ran it.
    first_scheduled_time: float | None = None

    def __reduce__(self) -> tuple[type["EngineCoreOutput"], tuple[object, ...]]:
        # A step's outputs cross a process boundary on the Ray path; default
        # pickling (class + field dict per object) cost ~0.5 ms for 64
        # decodes, positional args with the default tail cut off ~0.2 ms.
        args = (
            self.request_id,
            self.new_token_ids,
            self.new_logprobs,
            self.new_prompt_logprobs,
            self.finish_reason,
            self.stop_reason,
            self.num_cached_tokens,
            self.first_scheduled_time,
        )
        end = len(args)
        while end > 2 and args[end - 1] == _DEFAULTS[end - 1]:
            end -= 1
        return (EngineCoreOutput, args[:end])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_DEFAULTS: tuple[object, ...] = (None, None, None, None, None, None, 0, None)
