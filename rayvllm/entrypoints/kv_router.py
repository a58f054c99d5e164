"""`KVAwareRequestRouter`: Serve's request-router extension point, over
the Ray-free policy in core/replica_router.py.

Each LLMServer replica reports (its `record_routing_stats`, every
`request_routing_stats_period_s`) its load and the routing keys of the
blocks its engine caches, which the engine's block events keep exact. The
router hashes a request's prompt tokens as the engines do, asks the index
which replica holds the longest prefix, and ranks the replicas by queued
work plus uncached prompt (`rank_replicas`). A request it sends somewhere
counts there at once: its blocks, so a follow-up routed before the next
report finds them (they are kept over reports until one taken after the
request ended, which shows them or their eviction), and its uncached
prompt as queued work until it ends or a report taken after it was
routed arrives (`InflightTally`), so a burst spreads before the reports
catch up; once a report counts it, its end takes it off that report's
queue (a report taken while it queued can arrive after it ended). A
report replaces what the replica held (its evictions
included), and a replica that left is forgotten. Routing never waits for
a report: a replica without one counts as idle and empty.

The router reads a request's prompt and session from the call's
arguments: a Python handle call's (`handle.generate.remote(prompt, params,
session_id=...)`), or the hints that the router ingress in front of the
replicas worked out from an HTTP request (`prompt_token_ids`, `session_id`:
entrypoints/openai/routing_hints.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ray.serve.request_router import (
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from rayvllm.core.replica_router import (
    InflightTally,
    RecentRoutes,
    ReplicaLoad,
    ReplicaPrefixIndex,
    RoutingPolicy,
    SessionTable,
    decode_report,
    rank_replicas,
    report_taken_at,
)
from rayvllm.messages.block_hash import full_block_routing_keys, num_hit_blocks

# Sessions remembered (least recently used go first).
MAX_SESSIONS = 65536
# Requests whose routing waits for Serve's word on where they went (one
# cancelled before it was routed never gets it), and requests the load
# tally keeps: past it, the oldest go first.
MAX_PENDING_ROUTINGS = 65536
# RecentRoutes: how far two nodes' clocks may differ; it and InflightTally:
# how long a request whose end the router never learns is kept.
REPORT_CLOCK_SKEW_S = 1.0
RECENT_ROUTE_MAX_S = 300.0


@dataclass(frozen=True)
class _Routing:
    """What a request's routing saw, kept until Serve says where it went."""

    keys: list[bytes]
    session: str | None
    num_tokens: int
    hits: dict[str, int]


class KVAwareRequestRouter(MultiplexMixin, RequestRouter):
    """Not FIFO: a replica chosen for a request must serve that request
    (Serve's FIFO mixin hands it to whichever request waits first)."""

    def initialize_state(
        self, block_size: int = 16, model: str | None = None, max_kv_usage: float = 0.95,
        session_slack_tokens: int = 8192, **_: Any,
    ) -> None:
        """Serve's `request_router_kwargs`. `model`: where the tokenizer
        for text prompts comes from (token-id prompts need none)."""
        self._policy = RoutingPolicy(block_size, max_kv_usage, session_slack_tokens)
        self._model = model
        self._tokenizer: Any = None
        self._index = ReplicaPrefixIndex()
        self._loads: dict[str, ReplicaLoad] = {}
        self._seen_reports: dict[str, int] = {}  # replica -> id() of the report absorbed last
        self._recent = RecentRoutes(REPORT_CLOCK_SKEW_S, RECENT_ROUTE_MAX_S)
        self._sessions = SessionTable(MAX_SESSIONS)
        self._routing: OrderedDict[str, _Routing] = OrderedDict()  # internal request id -> what routing it saw
        self._inflight = InflightTally(RECENT_ROUTE_MAX_S, MAX_PENDING_ROUTINGS)

    # ---- Serve's hooks ---------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for gone in (set(self._index.replicas) | set(self._loads)) - live:
            self._forget(gone)
        for replica in replicas:
            self._absorb(replica)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        for replica in candidate_replicas:
            self._absorb(replica)
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if model_id:
            # An adapter's blocks hash under its id: its replicas are Serve's multiplexing's call.
            return self.rank_replicas_via_multiplex(candidate_replicas, model_id)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        keys, num_tokens, session = self._request_keys(pending_request)
        ids = list(by_id)
        lookup = keys[: num_hit_blocks(self._policy.block_size, num_tokens)]
        hits = self._index.prefix_hits(lookup, ids) if lookup else {}
        if pending_request is not None:
            self._routing[pending_request.metadata.internal_request_id] = _Routing(keys, session, num_tokens, hits)
            while len(self._routing) > MAX_PENDING_ROUTINGS:
                self._routing.popitem(last=False)
        sticky = self._sessions.get(session)
        ranks = rank_replicas(ids, num_tokens, hits, self._current_loads(ids), self._policy, sticky)
        if session is not None and sticky is None and ranks:
            self._sessions.claim(session, ranks[0][0])
            sticky = ranks[0][0]
        if ranks and (hits.get(ranks[0][0], 0) > 0 or ranks[0][0] == sticky):
            # Serve moves on to the next rank as soon as a replica misses its
            # queue-length probe deadline (0.1 s at first), which a busy
            # replica on a small machine can; the replica holding the prefix
            # or the session is worth that wait, so it is the only rank (a
            # replica that died leaves the candidates, and the next choice
            # goes elsewhere).
            return [[by_id[ranks[0][0]]]]
        return [[by_id[r] for r in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        routing = self._routing.pop(pending_request.metadata.internal_request_id, None)
        if routing is None:
            return
        keys, session = routing.keys, routing.session
        replica = replica_id.unique_id
        # Its prompt counts as queued there until it ends or a report taken
        # after now arrives.
        uncached = max(routing.num_tokens - routing.hits.get(replica, 0) * self._policy.block_size, 0)
        now = self._get_curr_time_s()
        self._inflight.add(pending_request.metadata.internal_request_id, replica, uncached, now)
        if keys:
            self._index.add(replica, keys)
            self._recent.add(replica, pending_request.metadata.internal_request_id, keys, now)
        if session is not None:
            self._sessions.routed(session, replica)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        now = self._get_curr_time_s()
        self._inflight.ended(internal_request_id, now)
        self._recent.ended(internal_request_id, now)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    # ---- helpers -----------------------------------------------------------------------

    def _absorb(self, replica: RunningReplica) -> None:
        """Take a replica's latest report, once per report."""
        report = replica.routing_stats
        rid = replica.replica_id.unique_id
        if not report or self._seen_reports.get(rid) == id(report):
            return
        self._seen_reports[rid] = id(report)
        load, keys = decode_report(report)
        self._loads[rid] = load
        self._inflight.after_report(rid, report_taken_at(report))
        self._index.replace(rid, keys)
        for routed in self._recent.after_report(rid, report_taken_at(report), self._get_curr_time_s()):
            self._index.add(rid, routed)

    def _current_loads(self, replicas: list[str]) -> dict[str, ReplicaLoad]:
        """Each replica's last report plus what was sent to it since, less
        the queued prompts of requests that report counts and that ended."""
        loads = {}
        for replica in replicas:
            load = self._loads.get(replica, ReplicaLoad())
            requests, tokens = self._inflight.load(replica)
            loads[replica] = replace(
                load, num_waiting=load.num_waiting + requests,
                num_queued_tokens=max(load.num_queued_tokens + tokens, 0),
            )
        return loads

    def _forget(self, replica: str) -> None:
        self._index.forget(replica)
        self._loads.pop(replica, None)
        self._inflight.forget(replica)
        self._seen_reports.pop(replica, None)
        self._recent.forget(replica)
        self._sessions.forget(replica)

    def _request_keys(self, pending_request: PendingRequest | None) -> tuple[list[bytes], int, str | None]:
        """The routing keys of all the prompt's full blocks (those the replica
        it goes to will hold; a lookup counts all but the last token's, as the
        engines count hits), its length, and its session; nothing for a
        request the router cannot read or whose blocks carry extra keys (an
        adapter, a cache salt)."""
        if pending_request is None:
            return [], 0, None
        args, kwargs = pending_request.args, pending_request.kwargs
        session = kwargs.get("session_id")
        if kwargs.get("lora_request") is not None:
            return [], 0, session
        if "prompt_token_ids" in kwargs:  # an HTTP request, through the router ingress
            tokens = kwargs["prompt_token_ids"]
        else:
            tokens = self._tokens(args[0] if args else kwargs.get("prompt"))
        if tokens is None:
            return [], 0, session
        return full_block_routing_keys(self._policy.block_size, tokens), len(tokens), session

    def _tokens(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if isinstance(prompt, str) and self._model is not None:
            if self._tokenizer is None:
                from rayvllm.utils.tokenizer import get_tokenizer

                self._tokenizer = get_tokenizer(self._model)
            return list(self._tokenizer(prompt).input_ids)
        return None
