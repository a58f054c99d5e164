"""The persistent batch: per-request state kept on the worker across steps.

Token ids and block tables live in preallocated numpy arrays indexed by a row
per request, so preparing a step's inputs is a handful of vectorised gathers
rather than per-token Python work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rayvllm.messages.pooling_params import PoolingParams
from rayvllm.messages.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """Invariant: `token_ids[row, :num_tokens]` holds prompt + output tokens,
    and `output_token_ids` is the same list the sampler reads for penalties."""

    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    num_blocks: int
    num_computed_tokens: int
    eos_token_id: int | None = None
    # Prompt logprobs computed so far (rows for positions 1..), streamed per step.
    wants_prompt_logprobs: bool = False
    # A pooling request's params, and its mean pooling's running sum over chunks.
    pooling_params: PoolingParams | None = None
    pooled_sum: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}

    def add(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        sampling_params: SamplingParams,
        block_ids: list[int],
        num_computed_tokens: int,
        generator: torch.Generator | None,
        pooling_params: PoolingParams | None = None,
    ) -> CachedRequestState:
        row = self._free_rows.pop()
        n_prompt = len(prompt_token_ids)
        self.token_ids[row, :n_prompt] = prompt_token_ids
        if output_token_ids:
            self.token_ids[row, n_prompt : n_prompt + len(output_token_ids)] = output_token_ids
        self.block_table[row, : len(block_ids)] = block_ids
        state = CachedRequestState(
            req_id=req_id,
            row=row,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=list(output_token_ids),
            sampling_params=sampling_params,
            generator=generator,
            num_blocks=len(block_ids),
            num_computed_tokens=num_computed_tokens,
            wants_prompt_logprobs=sampling_params.prompt_logprobs is not None,
            pooling_params=pooling_params,
        )
        self.requests[req_id] = state
        return state

    def append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        if block_ids:
            self.block_table[state.row, state.num_blocks : state.num_blocks + len(block_ids)] = block_ids
            state.num_blocks += len(block_ids)

    def append_token(self, state: CachedRequestState, token: int) -> None:
        pos = state.num_tokens
        if pos < self.max_model_len:
            self.token_ids[state.row, pos] = token
        state.output_token_ids.append(token)

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table[state.row, : state.num_blocks] = 0
            self._free_rows.append(state.row)
