"""`EngineClient` (vLLM's name): all the OpenAI layer knows of an engine.

The HTTP routes and the `OpenAIServing*` classes call these methods and
nothing else: no attribute of an engine's processor, metrics or config is
reached through. `AsyncLLM` implements it structurally (the engine sits
below this layer and never imports it); test fakes implement it too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rayvllm.entrypoints.openai.streams import OutputStream
from rayvllm.frontend.processor import PromptType
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.outputs import PoolingRequestOutput, RequestOutput, RequestOutputKind
from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.resume import ResumePoint
from rayvllm.messages.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EngineClient"]


@runtime_checkable
class EngineClient(Protocol):
    """One engine serving one base model.

    Invariant: every check and `add_request` raise a `RayvllmError` (a bad
    input, overload, a dead engine) before any token is computed, so a
    route can still answer with an error status.
    """

    @property
    def served_model_name(self) -> str:
        """The name requests use when they name no model."""
        ...

    @property
    def model_path(self) -> str:
        """What the model was loaded from (a path or a hub name)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> "PreTrainedTokenizerBase": ...

    # ---- requests -----------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        resume: ResumePoint | None = None,
        final_only: bool = False,
    ) -> OutputStream:
        """Admit the request now and return its stream of outputs (DELTA
        by default): each carries, for the sequences touched in a step,
        only what is new; `finished` is True on the last. Closing the
        stream before its end aborts the request. `resume`: continue a
        stream another engine began, after what its client has.
        `final_only`: only the finished output is read (FINAL_ONLY), so
        the engine need not send the tokens in between."""
        ...

    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        add_special_tokens: bool = True,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        lora_request: LoRARequest | None = None,
        resume: ResumePoint | None = None,
        final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """`add_request`'s outputs as an async generator; leaving it early aborts."""
        ...

    def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str, *, add_special_tokens: bool = True
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling request's one output; leaving early aborts."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def num_pending_requests(self) -> int:
        """User requests admitted and not yet finished."""
        ...

    # ---- checks and text ------------------------------------------------------------

    def check_runner(self, params: SamplingParams | PoolingParams) -> None:
        """Raise (a 400 naming `model`) unless this model serves `params`'
        kind of request: generation or pooling."""
        ...

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Raise (a 400 naming the adapter) unless this engine can run it."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The conversation as prompt text, with the model's chat template."""
        ...

    # ---- health and metrics -----------------------------------------------------------

    async def check_health(self, allow_restarting: bool = False) -> None:
        """Raise `EngineDeadError` unless the engine can serve; with
        `allow_restarting`, an engine replacing a failed core passes."""
        ...

    async def render_metrics(self) -> tuple[bytes, str]:
        """Fresh Prometheus text of the engine's metrics, and its Content-Type."""
        ...
