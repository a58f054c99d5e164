"""The request back end (vLLM v1's OutputProcessor): token ids in, RequestOutputs out.

Per engine step the engine core hands over `EngineCoreOutput`s (new token
ids, logprob rows, finish reasons) for the requests it advanced. This module
turns them into the `RequestOutput`s clients see: it detokenizes
incrementally, finds stop strings (and tells the engine to abort requests
that hit one, since the core only knows stop *tokens*), assembles logprob
dicts, stamps metrics, and shapes each update as CUMULATIVE, DELTA or
FINAL_ONLY. Requests with n > 1 were fanned out into children
(`processor.fan_out`); their outputs are gathered back into one
RequestOutput per user request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rayvllm.frontend.detokenizer import RequestDetokenizer
from rayvllm.messages.engine_types import EngineCoreOutput, LogprobsLists
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)
from rayvllm.messages.request import EngineCoreRequest, FinishReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["OutputProcessor", "OutputProcessorResult"]


@dataclass
class OutputProcessorResult:
    """What one call produced.

    `request_outputs`: at most one RequestOutput per user request, in the
    order their first engine output arrived. `reqs_to_abort`: engine-core
    request ids that hit a stop string here; the core still runs them and
    must abort them. Their state here is already gone.
    """

    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class _TokenTextCache(dict[int, str]):
    """Token id -> the token decoded alone, for Logprob.decoded_token.

    Logprob rows repeat the same frequent ids step after step; a dict bounded
    by the vocabulary makes each lookup one C-level dict hit instead of a
    tokenizer call (`__missing__` runs once per id).
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase") -> None:
        super().__init__()
        self._tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        try:
            text = str(self._tokenizer.decode([token_id]))
        except Exception:  # an id outside the tokenizer (padded vocab)
            text = ""
        self[token_id] = text
        return text


@dataclass(eq=False)
class _SequenceState:
    """One engine-core request: a whole n=1 request, or one child of n > 1.

    Invariants: `logprobs` (when requested) has one entry per output token;
    `prompt_logprobs` (when requested) starts with None and gains one entry
    per prompt position the core reported; the `sent_*` counters never
    exceed the lengths they index and only grow (DELTA bookkeeping).
    """

    request_id: str
    index: int
    group: "_RequestGroup"
    core_request: EngineCoreRequest
    detokenizer: RequestDetokenizer
    num_logprobs: int | None
    num_prompt_logprobs: int | None
    metrics: RequestMetrics
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    prompt_logprobs: PromptLogprobs | None
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: int = 0
    # Prompt logprob rows a resumed request's new core reports again.
    prompt_rows_to_skip: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_logprobs(self, rows: LogprobsLists, decode: _TokenTextCache) -> None:
        if self.logprobs is None or self.num_logprobs is None:
            return
        assert self.cumulative_logprob is not None
        for ids, lps, rank in zip(rows.logprob_token_ids, rows.logprobs, rows.ranks):
            self.logprobs.append(_logprob_dict(ids, lps, rank, self.num_logprobs, decode))
            self.cumulative_logprob += lps[0]

    def add_prompt_logprobs(self, rows: LogprobsLists, decode: _TokenTextCache) -> None:
        if self.prompt_logprobs is None or self.num_prompt_logprobs is None:
            return
        for ids, lps, rank in zip(rows.logprob_token_ids, rows.logprobs, rows.ranks):
            if self.prompt_rows_to_skip:
                self.prompt_rows_to_skip -= 1
                continue
            self.prompt_logprobs.append(_logprob_dict(ids, lps, rank, self.num_prompt_logprobs, decode))

    def take_prompt_logprobs(self, delta: bool) -> PromptLogprobs | None:
        """All prompt logprobs, or in DELTA mode those not sent yet (None if none)."""
        if self.prompt_logprobs is None:
            return None
        if not delta:
            return list(self.prompt_logprobs)
        new = self.prompt_logprobs[self.sent_prompt_logprobs :]
        self.sent_prompt_logprobs = len(self.prompt_logprobs)
        return new or None

    def make_output(self, kind: RequestOutputKind) -> CompletionOutput | None:
        """This sequence's CompletionOutput now, shaped by `kind`.

        None only for FINAL_ONLY before the end; a DELTA may be empty (text
        held back, or a step that only carried prompt logprobs).
        """
        finished = self.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        all_ids = self.detokenizer.output_token_ids
        logprobs: SampleLogprobs | None
        if delta:
            token_ids = all_ids[self.sent_tokens :]
            self.sent_tokens = len(all_ids)
            if self.logprobs is not None:
                logprobs = self.logprobs[self.sent_logprobs :]
                self.sent_logprobs = len(self.logprobs)
            else:
                logprobs = None
        else:
            # Copies: the caller may keep this output while we keep appending.
            token_ids = list(all_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(self.finish_reason) if finished else None,
            stop_reason=self.stop_reason,
        )


@dataclass(eq=False)
class _RequestGroup:
    """One user request: its n sequences and what to tell the client.

    Invariants: `sequences` maps index -> state for every child added so far
    (finished ones stay, for metrics and prompt logprobs); `unfinished` holds
    the engine-core ids still running; the request is finished once all `n`
    children were added and none is unfinished. `latest` holds each child's
    last CompletionOutput for CUMULATIVE and FINAL_ONLY aggregation.
    """

    request_id: str
    n: int
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    arrival_time: float
    sequences: dict[int, _SequenceState] = field(default_factory=dict)
    unfinished: set[str] = field(default_factory=set)
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    finished_time: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.n and not self.unfinished

    def metrics(self) -> RequestMetrics:
        if self.n == 1 and 0 in self.sequences:
            m = self.sequences[0].metrics
            # A snapshot (the state keeps changing); spelled out because
            # dataclasses.replace is several times slower on this hot path.
            return RequestMetrics(
                m.arrival_time, m.first_scheduled_time, m.first_token_time,
                m.last_token_time, m.finished_time, m.num_generation_tokens,
            )
        seqs = [s.metrics for s in self.sequences.values()]
        firsts = [m.first_token_time for m in seqs if m.first_token_time is not None]
        scheduled = [m.first_scheduled_time for m in seqs if m.first_scheduled_time is not None]
        lasts = [m.last_token_time for m in seqs if m.last_token_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(firsts) if firsts else None,
            last_token_time=max(lasts) if lasts else None,
            finished_time=self.finished_time,
            num_generation_tokens=sum(m.num_generation_tokens for m in seqs),
        )


def _logprob_dict(
    ids: list[int], lps: list[float], rank: int, num: int, decode: _TokenTextCache
) -> dict[int, Logprob]:
    """Row -> {token id: Logprob}: the chosen token (column 0) plus the top `num`.

    The runner may send more columns than this request wants (it computes
    the batch maximum), so the row is trimmed here. When the chosen token is
    itself in the top `num` the dict has `num` entries, else `num + 1`.
    """
    chosen = ids[0]
    out = {chosen: Logprob(lps[0], rank, decode[chosen])}
    for j in range(1, min(num, len(ids) - 1) + 1):
        token_id = ids[j]
        if token_id not in out:
            out[token_id] = Logprob(lps[j], j, decode[token_id])
    return out


class OutputProcessor:
    """Turns engine-core outputs into client-facing RequestOutputs.

    Single-threaded by design: the engine loop calls `add_request`,
    `process_outputs` and `abort_requests` from one thread (or one asyncio
    task). Invariant: a request's state lives here from `add_request` until
    it finishes or is aborted; outputs for unknown ids (already finished or
    aborted, still in flight in the core) are dropped silently.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase") -> None:
        self.tokenizer = tokenizer
        self._decode_token = _TokenTextCache(tokenizer)
        self._sequences: dict[str, _SequenceState] = {}
        self._groups: dict[str, _RequestGroup] = {}

    # ---- bookkeeping -------------------------------------------------------------

    def add_request(
        self,
        core_req: EngineCoreRequest,
        prompt: str | None,
        parent_id: str | None = None,
        index: int = 0,
        n: int = 1,
        output_kind: RequestOutputKind | None = None,
        sent_text_chars: int = 0,
    ) -> None:
        """Start tracking one engine-core request.

        For n > 1, call once per child (from `processor.fan_out`) with the
        user's request id as `parent_id`, the child's `index` and `n`. With
        `parent_id=None` the request stands alone and `n` must be 1.
        `output_kind` defaults to `sampling_params.output_kind` when that
        exists, else CUMULATIVE (vLLM's default). A request that resumes a
        stream from another engine comes with its `output_token_ids` (the
        tokens its client has) and `sent_text_chars` (of their text, what
        the client has): DELTA outputs continue after both. The logprobs of
        those tokens are not held here; the client has them.
        """
        req_id = core_req.request_id
        params = core_req.sampling_params
        group_id = parent_id if parent_id is not None else req_id
        if parent_id is None and (n != 1 or index != 0):
            raise InvalidParameterError("n", "a request with n > 1 needs a parent_id for its children")
        if not 0 <= index < n:
            raise InvalidParameterError("index", f"must be in [0, {n}), got {index}")
        if req_id in self._sequences or (parent_id is not None and req_id in self._groups):
            raise InvalidParameterError("request_id", f"request {req_id!r} is already running")
        kind = output_kind
        if kind is None:
            kind = getattr(params, "output_kind", None) or RequestOutputKind.CUMULATIVE
        kind = RequestOutputKind(kind)

        group = self._groups.get(group_id)
        if group is None:
            group = _RequestGroup(
                request_id=group_id,
                n=n,
                prompt=prompt,
                prompt_token_ids=list(core_req.prompt_token_ids),
                output_kind=kind,
                arrival_time=core_req.arrival_time,
            )
        elif parent_id is None or group.n != n or index in group.sequences:
            raise InvalidParameterError("request_id", f"request {group_id!r} is already running")

        wants_logprobs = params.logprobs is not None
        state = _SequenceState(
            request_id=req_id,
            index=index,
            group=group,
            core_request=core_req,
            detokenizer=RequestDetokenizer(self.tokenizer, core_req.prompt_token_ids, params),
            num_logprobs=params.logprobs,
            num_prompt_logprobs=params.prompt_logprobs,
            metrics=RequestMetrics(arrival_time=core_req.arrival_time),
            logprobs=[] if wants_logprobs else None,
            cumulative_logprob=0.0 if wants_logprobs else None,
            # The first prompt token has no logprob: nothing precedes it.
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if core_req.output_token_ids:
            state.detokenizer.resume(core_req.output_token_ids, sent_text_chars)
            state.sent_tokens = len(core_req.output_token_ids)
        # Registered only now, so a rejected add leaves no trace.
        self._groups[group_id] = group
        group.sequences[index] = state
        group.unfinished.add(req_id)
        if kind is RequestOutputKind.CUMULATIVE:
            group.latest[index] = CompletionOutput(
                index, "", [], state.cumulative_logprob, [] if wants_logprobs else None
            )
        self._sequences[req_id] = state

    def add_fanout(
        self,
        request_id: str,
        core_reqs: list[EngineCoreRequest],
        prompt: str | None,
        output_kind: RequestOutputKind | None = None,
        sent_text_chars: int = 0,
    ) -> None:
        """Track what `Processor.process_with_fanout` made of user request
        `request_id`: the request itself, or its n children as one group
        (`sent_text_chars`: as for `add_request`)."""
        n = len(core_reqs)
        for index, core_req in enumerate(core_reqs):
            self.add_request(
                core_req, prompt, parent_id=request_id if n > 1 else None, index=index, n=n,
                output_kind=output_kind, sent_text_chars=sent_text_chars,
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self._sequences)

    def drop_requests(self, core_ids: Iterable[str]) -> list[str]:
        """Forget the user requests that engine-core requests `core_ids`
        belong to (every child of an n > 1 request), with no output: they
        failed. Returns their user request ids; unknown ids are ignored."""
        dropped: list[str] = []
        for core_id in core_ids:
            state = self._sequences.get(core_id)
            if state is None or state.group.request_id in dropped:
                continue
            group = state.group
            dropped.append(group.request_id)
            for child in group.sequences.values():
                self._sequences.pop(child.request_id, None)
            group.unfinished.clear()
            self._groups.pop(group.request_id, None)
        return dropped

    def resumable_requests(self) -> list[list[EngineCoreRequest]]:
        """Every unfinished request as a new engine core must take it after
        the old one died: the request as first added, with the tokens it
        has produced so far as `output_token_ids`, so the new core continues
        it with no token repeated or lost. One list per user request (the
        children of an n > 1 request together, to share a DP rank). The new
        core reports the prompt logprob rows already held here again; they
        are skipped."""
        groups: dict[str, list[EngineCoreRequest]] = {}
        for state in self._sequences.values():
            if state.prompt_logprobs is not None:
                state.prompt_rows_to_skip = len(state.prompt_logprobs) - 1  # its first entry is the None
            resumed = replace(state.core_request, output_token_ids=list(state.detokenizer.output_token_ids))
            groups.setdefault(state.group.request_id, []).append(resumed)
        return list(groups.values())

    def get_num_unfinished_requests(self) -> int:
        """Engine-core requests still running (a request with n=4 counts 4)."""
        return len(self._sequences)

    def get_num_unfinished_user_requests(self) -> int:
        """User requests still running (a request with n=4 counts 1)."""
        return len(self._groups)

    def child_request_ids(self, request_ids: Iterable[str]) -> list[str]:
        """Running engine-core ids behind the given user (or child) request ids.

        A user id of an n > 1 request expands to its unfinished children; an
        id that is itself an engine-core id maps to itself; unknown ids vanish.
        """
        out: dict[str, None] = {}  # ordered set: an id named twice is aborted once
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is not None:
                for _, state in sorted(group.sequences.items()):
                    if state.request_id in group.unfinished:
                        out[state.request_id] = None
            elif request_id in self._sequences:
                out[request_id] = None
        return list(out)

    # ---- the per-step path -------------------------------------------------------

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> OutputProcessorResult:
        """Fold engine-core outputs into RequestOutputs: one per touched user
        request, even when `outputs` spans several steps (a request's
        outputs then appear in step order and their deltas are joined).

        `now` (default `time.time()`) stamps token and finish times; tests
        pass it to get deterministic metrics.
        """
        now = time.time() if now is None else now
        result = OutputProcessorResult()
        # Sequences with something new, in arrival order; each is shown once,
        # after all of its outputs are folded in.
        touched_states: dict[str, _SequenceState] = {}
        for out in outputs:
            state = self._sequences.get(out.request_id)
            if state is None:
                continue  # finished or aborted here while still in flight in the core
            if out.pooling_output is not None:
                result.request_outputs.append(self._finish_pooling(state, out, now))
                continue
            new_ids = out.new_token_ids
            metrics = state.metrics
            if out.first_scheduled_time is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = out.first_scheduled_time
            if new_ids:
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
            # Fixed at first scheduling; outputs that only carry prompt
            # logprobs may leave it at 0, so never let one lower it.
            if out.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None:
                state.add_prompt_logprobs(out.new_prompt_logprobs, self._decode_token)

            finish_reason = out.finish_reason
            stop_reason = out.stop_reason
            num_before = len(state.detokenizer.output_token_ids)
            stop_str = state.detokenizer.update(
                new_ids,
                stop_terminated=finish_reason is FinishReason.STOP,
                final=finish_reason is not None,
            )
            # A stop string inside a speculative step's run drops the ids after it.
            kept = len(state.detokenizer.output_token_ids) - num_before
            metrics.num_generation_tokens += kept
            if out.new_logprobs is not None:
                rows = out.new_logprobs if kept == len(new_ids) else out.new_logprobs.slice(0, kept)
                state.add_logprobs(rows, self._decode_token)
            if stop_str is not None:
                # A stop string wins even when the core ended the request in
                # the same step (length): the text was cut at it.
                if finish_reason is None:
                    result.reqs_to_abort.append(state.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            if finish_reason is not None:
                self._finish(state, finish_reason, stop_reason, now)
            touched_states[state.request_id] = state

        # Groups with something to show, with each touched child's fresh output.
        touched: dict[str, dict[int, CompletionOutput]] = {}
        for state in touched_states.values():
            completion = state.make_output(state.group.output_kind)
            if completion is not None:  # None: FINAL_ONLY and still running
                touched.setdefault(state.group.request_id, {})[state.index] = completion
        result.request_outputs += self._make_request_outputs(touched)
        return result

    def abort_requests(self, request_ids: Iterable[str], now: float | None = None) -> list[RequestOutput]:
        """Drop the given requests (user ids or child ids); unknown ids are ignored.

        Returns a final RequestOutput (finish_reason "abort") per affected
        user request, so a streaming consumer sees its stream end. The engine
        aborts the same requests in the core: `child_request_ids(ids)` names
        them (call it first; afterwards their state is gone).
        """
        now = time.time() if now is None else now
        touched: dict[str, dict[int, CompletionOutput]] = {}
        for core_id in self.child_request_ids(request_ids):
            state = self._sequences[core_id]
            state.detokenizer.finish()
            self._finish(state, FinishReason.ABORT, None, now)
            completion = state.make_output(state.group.output_kind)
            assert completion is not None  # finished: every kind shows it
            touched.setdefault(state.group.request_id, {})[state.index] = completion
        return self._make_request_outputs(touched)

    # ---- helpers -----------------------------------------------------------------

    def _finish(self, state: _SequenceState, reason: FinishReason, stop_reason: int | str | None, now: float) -> None:
        state.finish_reason = reason
        state.stop_reason = stop_reason
        state.metrics.finished_time = now
        del self._sequences[state.request_id]
        group = state.group
        group.unfinished.discard(state.request_id)
        if group.finished:
            group.finished_time = now

    def _finish_pooling(self, state: _SequenceState, out: EngineCoreOutput, now: float) -> PoolingRequestOutput:
        """A pooling request's one output: its vector, and it is done."""
        import torch  # a pooling front end's only torch: generating ones never load it

        assert out.pooling_output is not None
        state.metrics.first_scheduled_time = out.first_scheduled_time
        self._finish(state, FinishReason.STOP, None, now)
        group = state.group
        del self._groups[group.request_id]
        return PoolingRequestOutput(
            request_id=group.request_id,
            outputs=PoolingOutput(torch.from_numpy(out.pooling_output)),
            prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=out.num_cached_tokens,
        )

    def _make_request_outputs(self, touched: dict[str, dict[int, CompletionOutput]]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for group_id, changed in touched.items():
            request_output = self._make_request_output(self._groups[group_id], changed)
            if request_output is not None:
                outputs.append(request_output)
        return outputs

    def _make_request_output(
        self, group: _RequestGroup, changed: dict[int, CompletionOutput]
    ) -> RequestOutput | None:
        """The group's RequestOutput for this call, or None if there is nothing to say."""
        kind = group.output_kind
        finished = group.finished
        delta = kind is RequestOutputKind.DELTA
        if not delta:
            group.latest.update(changed)
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # Children share the prompt; child 0 speaks for all of them.
        first = group.sequences.get(0)
        prompt_logprobs = first.take_prompt_logprobs(delta) if first is not None else None
        if delta:
            deltas = [changed[i] for i in sorted(changed)]
            outputs = [o for o in deltas if o.text or o.token_ids or o.finished()]
            if not outputs:
                if prompt_logprobs is None:
                    return None  # nothing new to stream
                # Still hand over the (empty) sequences: consumers index outputs.
                outputs = deltas
        else:
            outputs = [group.latest[i] for i in sorted(group.latest)]
        if finished:
            del self._groups[group.request_id]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            metrics=group.metrics(),
            num_cached_tokens=first.num_cached_tokens if first is not None else None,
        )


def mark_final_only(requests: list[EngineCoreRequest], kind: RequestOutputKind) -> list[EngineCoreRequest]:
    """`requests` marked `final_only` where this side needs nothing from them
    before they end: a FINAL_ONLY output, no stop string to look for in the
    text, no logprobs to collect step by step. The core then sends each its
    first token and its last; a step of such requests pushes nothing."""
    if kind is not RequestOutputKind.FINAL_ONLY:
        return requests
    return [
        replace(r, final_only=True)
        if r.pooling_params is None
        and not r.sampling_params.stop
        and r.sampling_params.logprobs is None
        and r.sampling_params.prompt_logprobs is None
        else r
        for r in requests
    ]
