"""What each hook of a `ModelRunnerExtension` is given: the part of the
runner's setup or step that the features use, and the fields through which
they hand results back. No context points back at the runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from rayvllm.messages.engine_types import SpecDecodeOutput
from rayvllm.messages.scheduler_output import SchedulerOutput
from rayvllm.model_executor.input_batch import CachedRequestState
from rayvllm.models.interface import CausalLM

# (model, states, starts, q_lens) -> hidden states of `model` at the last of
# each request's positions [start, start + q_len), whose tokens are in the
# persistent batch; one row per state, in their order.
ForwardPositions = Callable[[CausalLM, list[CachedRequestState], np.ndarray, np.ndarray], torch.Tensor]


@dataclass
class ModelLoadContext:
    """The loaded target model and where it runs. `fused_kv_write`: the
    attention backend writes KV inside its fused CPU kernel, so any other
    model sharing the caches must be loaded the same way. `to_device`:
    the runner's upload of host tensors (pinned, non-blocking on CUDA)."""

    model: CausalLM
    dtype: torch.dtype
    device: torch.device
    fused_kv_write: bool
    to_device: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class BeginStepContext:
    """A step's scheduler output. An extension that copies KV blocks in
    adds the blocks whose load failed to `kv_load_failures` (their
    contents are undefined), which the step's output reports."""

    scheduler_output: SchedulerOutput
    kv_load_failures: list[int] = field(default_factory=list)


@dataclass
class PrepareInputsContext:
    """The step's requests in batch order, the tokens each runs
    (`q_lens[i]` for `states[i]`), and the requests that sample one token
    at the end of the step, in the order of their logits rows."""

    states: list[CachedRequestState]
    q_lens: np.ndarray
    sampling: list[CachedRequestState]


@dataclass
class LogitsContext:
    """`logits`: one row per request of `sampling`, then each request of
    `verifying` in turn with `len(drafts[req_id]) + 1` rows (its drafts'
    positions and the one after). Hooks may edit the rows in place."""

    logits: torch.Tensor
    sampling: list[CachedRequestState]
    verifying: list[CachedRequestState]
    drafts: dict[str, list[int]]

    @property
    def sampling_logits(self) -> torch.Tensor:
        return self.logits[: len(self.sampling)]

    @property
    def verify_logits(self) -> torch.Tensor:
        return self.logits[len(self.sampling) :]


@dataclass
class SampleContext:
    """After the sampling rows drew `sampled_token_ids` (one per request of
    `sampling`, already appended to the persistent batch). `verifying`,
    `verify_logits` and `drafts` as in `LogitsContext`, masked by its hooks.

    An extension that verifies drafts emits the tokens each verifying
    request keeps through `emit_verified` (appended to the batch, listed
    in `verified` for the extensions after it) and reports in
    `spec_decode`. `token_ids` is the persistent batch's token array:
    positions past a request's `num_tokens` are free for lookahead tokens
    that `forward_positions` should read."""

    sampling: list[CachedRequestState]
    sampled_token_ids: list[int]
    verifying: list[CachedRequestState]
    verify_logits: torch.Tensor
    drafts: dict[str, list[int]]
    token_ids: np.ndarray
    forward_positions: ForwardPositions
    append_token: Callable[[CachedRequestState, int], None]
    verified: dict[str, list[int]] = field(default_factory=dict)
    spec_decode: SpecDecodeOutput | None = None

    def emit_verified(self, state: CachedRequestState, tokens: list[int]) -> None:
        for token in tokens:
            self.append_token(state, token)
        self.verified[state.req_id] = tokens
