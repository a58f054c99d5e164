"""Drafts from a smaller model (vLLM's "draft_model" method), run by the
sampling rank of the worker group, unsharded, next to the target.

KV invariant: the draft model has its own cache tensors but uses the
target's block table, so a request's position p lives in the same block
and slot for both models (the scheduler allocates `num_speculative_tokens`
lookahead slots so the draft can cache its own drafts). Per request,
`DraftState.num_valid` (kept here while the request is in the runner's
batch) counts the leading positions whose draft KV was
computed from the tokens that are there now; proposing first catches the
draft up from there to the request's last token (the whole sequence for a
new or resumed request, so prefix-cache hits, whose blocks may never have
held this model's KV, get it rewritten: identical values, the same tokens
at the same positions), then runs k - 1 single-token steps. The KV of
those drafts stays valid for as many of them as the target accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from rayvllm.config import SpeculativeConfig, read_hf_config
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.sampling_params import SamplingParams
from rayvllm.model_executor.extension_context import ForwardPositions, ModelLoadContext
from rayvllm.model_executor.input_batch import CachedRequestState
from rayvllm.model_executor.sampler import categorical_inverse_cdf
from rayvllm.models.interface import CausalLM
from rayvllm.models.loader import load_model
from rayvllm.spec_decode.rejection_sampler import step_generator, target_probs


@dataclass
class DraftState:
    """The draft model's progress on one request (see the module docstring).
    `written`: drafts whose KV sits at positions `num_valid`, ... ;
    `probs`: [k, V] distributions the latest drafts of a random request
    were drawn from (None for greedy requests)."""

    num_valid: int = 0
    written: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """q for a random request's drafts: the draft model's logits under the
    request's own sampling rule (any q keeps verification exact; one
    closer to the target's accepts more)."""
    return target_probs(logits.float().clone(), params)


class DraftModelProposer:
    """Invariant: `states` holds a `DraftState` only for requests in the
    runner's batch (`forget` drops the others as they leave or restart)."""

    def __init__(self, config: SpeculativeConfig, target_head_dim: int) -> None:
        assert config.model is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        self.model_path = config.model
        self.target_head_dim = target_head_dim
        self.model: CausalLM | None = None
        self.states: dict[str, DraftState] = {}

    def load_model(self, ctx: ModelLoadContext) -> None:
        """On the target's device, in its dtype, writing KV as the target does."""
        hf_config = read_hf_config(self.model_path)
        self.model = load_model(
            self.model_path, hf_config, ctx.dtype, str(ctx.device), fused_kv_write=ctx.fused_kv_write
        )
        draft_dim = self.model.attention_layers()[0].head_dim
        if draft_dim != self.target_head_dim:
            # One attention backend (chosen for the target's head size) serves both.
            raise InvalidParameterError(
                "speculative_config.model",
                f"head_dim {draft_dim} differs from the target model's {self.target_head_dim}",
            )

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    def propose(
        self,
        states: list[CachedRequestState],
        max_drafts: list[int],
        token_ids: np.ndarray,
        forward_positions: ForwardPositions,
    ) -> dict[str, list[int]]:
        """Drafts for each state (up to its `max_drafts` entry, > 0); the
        tokens of each sit in `token_ids` (the persistent batch's), where
        the drafts are written too, past each request's last token, for
        `forward_positions` to read."""
        assert self.model is not None
        starts = np.empty(len(states), dtype=np.int64)
        for i, state in enumerate(states):
            draft = self.states.get(state.req_id)
            if draft is None:
                draft = self.states[state.req_id] = DraftState()
            valid = draft.num_valid
            for token in draft.written:
                if valid >= state.num_tokens or token_ids[state.row, valid] != token:
                    break
                valid += 1
            starts[i] = min(valid, state.num_tokens - 1)
        ends = np.fromiter((s.num_tokens for s in states), np.int64, len(states))
        logits = self.model.compute_logits(forward_positions(self.model, states, starts, ends - starts))
        drafts = np.zeros((len(states), max(max_drafts)), dtype=np.int64)
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        live = list(range(len(states)))  # rows of `logits`, in order
        for step in range(drafts.shape[1]):
            live_states = [states[i] for i in live]
            drafts[live, step] = self._pick(logits, live_states, [probs[i] for i in live])
            keep = [j for j, i in enumerate(live) if max_drafts[i] > step + 1]
            if not keep:
                break
            live = [live[j] for j in keep]
            live_states = [states[i] for i in live]
            pos = ends[live] + step
            token_ids[[s.row for s in live_states], pos] = drafts[live, step]
            hidden = forward_positions(self.model, live_states, pos, np.ones(len(live), dtype=np.int64))
            logits = self.model.compute_logits(hidden)
        out: dict[str, list[int]] = {}
        for i, state in enumerate(states):
            n = max_drafts[i]
            proposed = drafts[i, :n].tolist()
            draft = self.states[state.req_id]
            draft.num_valid = state.num_tokens
            draft.written = proposed[:-1]
            draft.probs = torch.stack(probs[i][:n]) if probs[i] else None
            out[state.req_id] = proposed
        return out

    @staticmethod
    def _pick(
        logits: torch.Tensor, states: list[CachedRequestState], probs: list[list[torch.Tensor]]
    ) -> np.ndarray:
        """One draft per row: the argmax for greedy requests, a draw from
        `draft_distribution` (kept in `probs`) for random ones."""
        picked = logits.argmax(-1).cpu().numpy()
        for i, state in enumerate(states):
            params = state.sampling_params
            if params.greedy:
                continue
            q = draft_distribution(logits[i : i + 1], params)
            seed = params.seed if state.generator is not None else None
            gen = step_generator(seed, len(state.output_token_ids), 1 + len(probs[i]), q.device)
            u = torch.rand(1, dtype=torch.float64, generator=gen, device=q.device)
            picked[i] = int(categorical_inverse_cdf(q, u)[0])
            probs[i].append(q[0])
        return picked

    def draft_probs(self, req_id: str, num: int) -> torch.Tensor | None:
        """The distributions of the first `num` drafts last proposed for `req_id`."""
        draft = self.states.get(req_id)
        return None if draft is None or draft.probs is None else draft.probs[:num]
