"""Structured outputs on the sampling worker: one grammar matcher per
constrained request, its next-token bitmask filled while the forward runs,
applied by the sampler before it samples.

Where the state lives. Only the rank that samples (the driver) has
matchers, in this manager, keyed by request id beside the runner's
persistent batch. A matcher is built from what the request's
`NewRequestData` carries (its params and the tokens it has emitted), and
advanced over those tokens; so a request resumed after preemption, or on a
new engine after a fault (the front end's request table resends prompt +
emitted tokens), gets the matcher it had, and nothing about grammars lives
anywhere else. The Ray path needs nothing more: the params travel with the
request, the worker actor compiles.

Threads. A new request's matcher is built (its grammar compiled, tens of
milliseconds to seconds by vocabulary, then cached) on a compile thread
from the moment the worker first sees the request, so it overlaps the
prompt's forward and never delays the masks of other requests; a step's
masks are filled on a fill thread from the moment the step is planned, so
they overlap the forward (xgrammar releases the GIL for both). A fill
waits for the matchers of its own rows only. Each matcher is touched by
one thread at a time: the compile thread until it is built, then the fill
thread during a fill of its row, then the runner's thread in
`accept_tokens`, which runs only after the step's fill is done.

Invariant (what makes async scheduling correct): the bitmask a request's
row gets in step k is filled from its matcher after that matcher accepted
every token the request sampled before step k. Matchers advance in
`accept_tokens` right after the sampler returns, on this worker, which
runs steps in the order they were scheduled; the fill for step k is
submitted only when step k starts here. The scheduler may send step k
before it has seen step k-1's token, but this worker has it by then (the
same reason the runner can feed that token as step k's input).

A matcher that has terminated (its request sampled a stop token) leaves its
row unconstrained: under async scheduling the request may be in one more
step, whose token is dropped when its end is seen.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rayvllm.config import ModelConfig
from rayvllm.messages.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rayvllm.structured_output.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class GrammarBitmask:
    """The bitmask of a sampling batch, one row per batch row; only the
    `rows` (None: all) are constrained, the others are left unread."""

    bitmask: torch.Tensor  # [B, ceil(V / 32)] int32
    rows: list[int] | None


class StructuredOutputManager:
    """The matchers of one runner's constrained requests (see the module
    docstring for the threading and ordering rules)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self._compiler: "GrammarCompiler | None" = None
        self._matchers: dict[str, Future[Any]] = {}
        self._pools: dict[str, ThreadPoolExecutor] = {}

    # ---- requests in and out (the runner's thread) --------------------------------

    def add_request(self, req_id: str, params: SamplingParams, output_token_ids: list[int]) -> None:
        """Start building `req_id`'s matcher, advanced over the tokens it has
        already emitted (a resumed request). No-op for an unconstrained one."""
        self._matchers.pop(req_id, None)
        if params.structured_outputs is None:
            return
        self._matchers[req_id] = self._submit("compile", self._build, params, list(output_token_ids))

    def remove_request(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    @property
    def has_requests(self) -> bool:
        return bool(self._matchers)

    def prepare_bitmask(self, req_ids: list[str]) -> Future[GrammarBitmask] | None:
        """Start filling the bitmask of a sampling batch whose row i is
        `req_ids[i]`; None when no row is constrained."""
        rows = [(i, self._matchers[r]) for i, r in enumerate(req_ids) if r in self._matchers]
        if not rows:
            return None
        return self._submit("fill", self._fill, rows, len(req_ids))

    def accept_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Advance the matchers of a step's constrained rows by their sampled
        tokens; call only after that step's bitmask future is done."""
        for req_id, token in zip(req_ids, token_ids):
            future = self._matchers.get(req_id)
            if future is None:
                continue
            matcher = future.result()
            if not matcher.is_terminated() and not matcher.accept_token(token):
                raise RuntimeError(f"request {req_id}: its grammar rejected token {token} sampled under its mask")

    def draft_bitmask(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The bitmask of a verifying request's `len(drafts) + 1` positions:
        row j is its grammar's after the drafts before j (the matcher is
        advanced over them, then rolled back). Rows past a draft the grammar
        rejects, or past the grammar's end, allow everything: verification
        rejects that draft (its masked probability is 0), so they are never
        used. None for an unconstrained request. On the runner's thread; the
        request is not in this step's fill (it verifies instead of sampling)."""
        future = self._matchers.get(req_id)
        if future is None:
            return None
        matcher = future.result()
        bitmask = torch.full((len(drafts) + 1, -(-self.vocab_size // 32)), -1, dtype=torch.int32)
        advanced = 0
        for row in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, row)
            if row == len(drafts) or not matcher.accept_token(drafts[row]):
                break
            advanced += 1
        if advanced:
            matcher.rollback(advanced)
        return bitmask

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # ---- on the compile and fill threads ----------------------------------------------

    def _submit(self, thread: str, fn: Any, *args: Any) -> Future[Any]:
        pool = self._pools.get(thread)
        if pool is None:
            pool = self._pools[thread] = ThreadPoolExecutor(1, thread_name_prefix=f"rayvllm-grammar-{thread}")
        return pool.submit(fn, *args)

    def _grammar_compiler(self) -> "GrammarCompiler":
        """Built on the first constrained request: it loads the tokenizer and
        decodes its vocabulary, which an engine without such requests never needs."""
        if self._compiler is None:
            from rayvllm.structured_output.grammar import GrammarCompiler
            from rayvllm.utils.tokenizer import get_tokenizer

            self._compiler = GrammarCompiler(get_tokenizer(self.model_config.tokenizer), self.vocab_size)
        return self._compiler

    def _build(self, params: SamplingParams, tokens: list[int]) -> Any:
        assert params.structured_outputs is not None
        matcher = self._grammar_compiler().matcher(params.structured_outputs, sorted(params.all_stop_token_ids))
        for token in tokens:
            # A resumed request's tokens were all sampled under this grammar.
            if matcher.is_terminated() or not matcher.accept_token(token):
                raise RuntimeError(f"a resumed request's token {token} does not fit its grammar")
        return matcher

    def _fill(self, rows: list[tuple[int, Future[Any]]], num_rows: int) -> GrammarBitmask:
        bitmask = torch.empty((num_rows, -(-self.vocab_size // 32)), dtype=torch.int32)
        for i, future in rows:
            matcher = future.result()  # waits for a compile still running
            if matcher.is_terminated():
                bitmask[i] = -1
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        return GrammarBitmask(bitmask, None if len(rows) == num_rows else [i for i, _ in rows])
