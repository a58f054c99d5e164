"""Pick the Serve replica for a request: the one that can start it soonest,
counting its cached prefix as work it does not have to do.

A replica's cost for a request is the prefill queued ahead of it plus the
part of the request's prompt it has not cached: ``queued_tokens +
prompt_tokens - hit_tokens``. A long hit wins while its replica's queue is
short; as a hot prefix piles requests onto one replica its queue grows
until recomputing the prefix elsewhere is cheaper, so the prefix spreads
instead of drowning one replica. A session (the `x-session-id` header or
the `user` field) stays on its replica while that replica is not
overloaded. Ties go to the longer hit, then fewer running requests, then
the replica id.

Ray-free: the Serve request router (entrypoints/kv_router.py) feeds the
index from the replicas' reports and asks `rank_replicas`.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rayvllm.messages.block_hash import ROUTING_KEY_BYTES


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as it last reported it: requests running and
    waiting, prompt tokens still to prefill (waiting and partly prefilled
    requests), and the fraction of its KV blocks in use."""

    num_running: int = 0
    num_waiting: int = 0
    num_queued_tokens: int = 0
    kv_usage: float = 0.0


def encode_report(load: ReplicaLoad, keys: Iterable[bytes]) -> dict[str, Any]:
    """A replica's report as Serve carries it (its `record_routing_stats`):
    plain values, the keys packed into one bytes string, and when it was
    taken (wall clock: a router on another node compares it with its own)."""
    return {
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "num_queued_tokens": load.num_queued_tokens,
        "kv_usage": load.kv_usage,
        "block_keys": b"".join(keys),
        "taken_at": time.time(),
    }


def report_taken_at(report: dict[str, Any]) -> float:
    """When the replica took `report` (0 for a report that does not say)."""
    return float(report.get("taken_at", 0.0))


def decode_report(report: dict[str, Any]) -> tuple[ReplicaLoad, list[bytes]]:
    """`encode_report`'s inverse; a report without keys (none yet) is idle and empty."""
    load = ReplicaLoad(
        int(report.get("num_running", 0)), int(report.get("num_waiting", 0)),
        int(report.get("num_queued_tokens", 0)), float(report.get("kv_usage", 0.0)),
    )
    packed: bytes = report.get("block_keys", b"")
    n = ROUTING_KEY_BYTES
    return load, [packed[i : i + n] for i in range(0, len(packed) - n + 1, n)]


class ReplicaPrefixIndex:
    """Per replica, the routing keys (`routing_key`) of the blocks it caches.

    Fed two ways: `replace` with a replica's own report (authoritative: what
    it evicted disappears), and `add` when a request is sent there (the
    replica will have cached those blocks once it prefills them, so a
    follow-up routed before the next report still finds them). `forget`
    drops a replica that left. Invariant: `_holders[k]` is exactly the set
    of replicas whose `_keys` contain `k`, and no holder set is empty.
    """

    def __init__(self) -> None:
        self._keys: dict[str, set[bytes]] = {}
        self._holders: dict[bytes, set[str]] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self._keys)

    def num_blocks(self, replica: str) -> int:
        return len(self._keys.get(replica, ()))

    def replace(self, replica: str, keys: Iterable[bytes]) -> None:
        new = set(keys)
        old = self._keys.get(replica, set())
        for key in old - new:
            self._drop(key, replica)
        for key in new - old:
            self._holders.setdefault(key, set()).add(replica)
        self._keys[replica] = new

    def add(self, replica: str, keys: Iterable[bytes]) -> None:
        held = self._keys.setdefault(replica, set())
        for key in keys:
            if key not in held:
                held.add(key)
                self._holders.setdefault(key, set()).add(replica)

    def forget(self, replica: str) -> None:
        for key in self._keys.pop(replica, set()):
            self._drop(key, replica)

    def prefix_hits(self, keys: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """For each of `replicas`, how many leading blocks of `keys` it holds
        (a chain: a later block is useless without the earlier ones)."""
        hits = {r: len(keys) for r in replicas}
        alive = set(hits)
        for i, key in enumerate(keys):
            still = alive & self._holders.get(key, set())
            for replica in alive - still:
                hits[replica] = i
            alive = still
            if not alive:
                break
        return hits

    def _drop(self, key: bytes, replica: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]


class RecentRoutes:
    """The blocks of requests a router sent to each replica that the
    replica's reports may not show yet.

    A report can predate a request's prefill and reach the router seconds
    later on a busy node; replacing the replica's keys with it would lose a
    prefix that a follow-up is about to need. So each route's keys are
    re-added over every report until one taken more than `clock_skew_s`
    after the request ended (the clocks of two nodes may differ by so
    much): that report shows the blocks, or their eviction. A route whose
    end the router never learns goes after `max_age_s`.
    """

    def __init__(self, clock_skew_s: float, max_age_s: float) -> None:
        self.clock_skew_s = clock_skew_s
        self.max_age_s = max_age_s
        # replica -> (routed at, request id, keys), oldest first
        self._routes: dict[str, deque[tuple[float, str, list[bytes]]]] = {}
        self._ended_at: dict[str, float] = {}  # request id -> wall clock; inf while it runs

    def add(self, replica: str, request: str, keys: list[bytes], now: float) -> None:
        self._routes.setdefault(replica, deque()).append((now, request, keys))
        self._ended_at[request] = math.inf

    def ended(self, request: str, at: float) -> None:
        """Request `request` ended at wall-clock time `at` (unknown ids are ignored)."""
        if request in self._ended_at:
            self._ended_at[request] = at

    def after_report(self, replica: str, taken_at: float, now: float) -> list[list[bytes]]:
        """The keys to add back to what a report of `replica` taken at
        `taken_at` says it holds; routes that report covers are dropped."""
        routes = self._routes.get(replica)
        if not routes:
            return []
        self._routes[replica] = kept = deque()
        for routed_at, request, keys in routes:
            if routed_at < now - self.max_age_s or taken_at > self._ended_at[request] + self.clock_skew_s:
                del self._ended_at[request]
                continue
            kept.append((routed_at, request, keys))
        return [keys for _, _, keys in kept]

    def forget(self, replica: str) -> None:
        for _, request, _ in self._routes.pop(replica, ()):
            del self._ended_at[request]

    def __len__(self) -> int:
        return len(self._ended_at)


@dataclass(slots=True)
class _Sent:
    """A request a router sent to a replica: its uncached prompt tokens,
    when it was routed and when it ended (wall clock; inf while it runs)."""

    tokens: int
    routed_at: float
    ended_at: float = math.inf


class InflightTally:
    """Per replica, how far its last report's load is from what the router
    knows since: the requests sent there that the report does not count yet
    (with their uncached prompt tokens, so a burst spreads before the
    reports catch up), less the queued tokens of requests the report counts
    that have since ended.

    A request adds to its replica's load until it ends or a report taken
    after it was routed arrives (that report shows it queued, running or
    done). A report taken before it, even one that reaches the router later,
    leaves it counted. Once such a report counts it, its end takes its
    tokens off that report's queue until a report taken after the end
    arrives: a report taken while it was queued can reach the router after
    it ended (so an ended request is kept until then), and its queue would
    otherwise outlive it. The reported queue
    is not split by request (the tokens deducted may already have been
    prefilled), so the caller clamps the sum at zero. A request whose end
    the router never learns is dropped `max_age_s` after it was routed; past
    `max_requests` (a replica that never reports) the oldest go first.
    """

    def __init__(self, max_age_s: float, max_requests: int) -> None:
        self.max_age_s = max_age_s
        self.max_requests = max_requests
        self._sent: dict[str, dict[str, _Sent]] = {}  # replica -> request id -> sent
        self._replica_of: dict[str, str] = {}  # request id -> replica
        self._report_at: dict[str, float] = {}  # replica -> when its last report was taken
        self._totals: dict[str, tuple[int, int]] = {}  # replica -> requests, tokens

    def add(self, request: str, replica: str, tokens: int, now: float) -> None:
        sent = _Sent(tokens, now)
        self._sent.setdefault(replica, {})[request] = sent
        self._replica_of[request] = replica
        self._count(replica, sent, 1)
        while len(self._replica_of) > self.max_requests:
            oldest = next(iter(self._replica_of))
            held_by = self._replica_of[oldest]
            self._count(held_by, self._sent[held_by][oldest], -1)
            self._drop(held_by, oldest)

    def ended(self, request: str, at: float) -> None:
        """`request` ended at wall-clock time `at` (unknown ids and a second end are ignored)."""
        replica = self._replica_of.get(request)
        if replica is None:
            return
        sent = self._sent[replica][request]
        if sent.ended_at != math.inf:
            return
        self._count(replica, sent, -1)
        sent.ended_at = at
        self._count(replica, sent, 1)

    def after_report(self, replica: str, taken_at: float) -> None:
        """A report of `replica` taken at `taken_at` is now its last."""
        self._report_at[replica] = taken_at
        self._totals.pop(replica, None)
        for request, sent in list(self._sent.get(replica, {}).items()):
            if sent.ended_at <= taken_at or sent.routed_at < taken_at - self.max_age_s:
                self._drop(replica, request)
            else:
                self._count(replica, sent, 1)

    def forget(self, replica: str) -> None:
        for request in self._sent.pop(replica, {}):
            del self._replica_of[request]
        self._report_at.pop(replica, None)
        self._totals.pop(replica, None)

    def load(self, replica: str) -> tuple[int, int]:
        """(requests, prompt tokens) to add to `replica`'s last report; the
        tokens may be negative (ended requests the report still queues)."""
        return self._totals.get(replica, (0, 0))

    def _share(self, replica: str, sent: _Sent) -> tuple[int, int]:
        report_at = self._report_at.get(replica, -math.inf)
        if sent.routed_at > report_at:  # the report does not count it
            return (1, sent.tokens) if sent.ended_at == math.inf else (0, 0)
        return (0, -sent.tokens) if report_at < sent.ended_at < math.inf else (0, 0)

    def _count(self, replica: str, sent: _Sent, sign: int) -> None:
        requests, tokens = self._share(replica, sent)
        had_requests, had_tokens = self._totals.get(replica, (0, 0))
        total = (had_requests + sign * requests, had_tokens + sign * tokens)
        if total == (0, 0):
            self._totals.pop(replica, None)
        else:
            self._totals[replica] = total

    def _drop(self, replica: str, request: str) -> None:
        del self._sent[replica][request]
        del self._replica_of[request]

    def __len__(self) -> int:
        return len(self._replica_of)


class SessionTable:
    """Which replica each session is on, the least recently used forgotten
    past `capacity`.

    A session's first request claims the replica it is ranked onto as soon
    as it is chosen (`claim`), before Serve confirms where it went
    (`routed`): the session's other requests that arrive meanwhile (a client
    opening several streams at once) follow it instead of spreading by load.
    Where a request actually went always wins over a claim.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        return self._replicas.get(session) if session is not None else None

    def claim(self, session: str, replica: str) -> None:
        """`replica`, if `session` is on none yet."""
        if session not in self._replicas:
            self.routed(session, replica)

    def routed(self, session: str, replica: str) -> None:
        self._replicas[session] = replica
        self._replicas.move_to_end(session)
        while len(self._replicas) > self.capacity:
            self._replicas.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Sessions on `replica` (it left) go wherever their next request is ranked."""
        for session in [s for s, r in self._replicas.items() if r == replica]:
            del self._replicas[session]

    def __len__(self) -> int:
        return len(self._replicas)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """`block_size`: the engines' KV block size (hits count whole blocks).
    `max_kv_usage`: above it a replica is overloaded (no new session or
    prefix preference sends it more). `session_slack_tokens`: a session
    stays on its replica while that replica's queue is at most this many
    tokens longer than the shortest."""

    block_size: int = 16
    max_kv_usage: float = 0.95
    session_slack_tokens: int = 8192


def rank_replicas(
    replicas: Sequence[str],
    prompt_tokens: int,
    hits: dict[str, int],
    loads: dict[str, ReplicaLoad],
    policy: RoutingPolicy,
    session_replica: str | None = None,
) -> list[list[str]]:
    """Replicas in order of preference, one per rank (Serve tries the first
    rank first, then falls back). `hits`: leading cached blocks per replica;
    a replica with no report yet counts as idle and empty."""
    if not replicas:
        return []
    empty = ReplicaLoad()

    def cost(replica: str) -> tuple[int, int, int, str]:
        load = loads.get(replica, empty)
        hit_tokens = min(hits.get(replica, 0) * policy.block_size, max(prompt_tokens - 1, 0))
        return (load.num_queued_tokens + prompt_tokens - hit_tokens, -hit_tokens, load.num_running, replica)

    def overloaded(replica: str) -> bool:
        return loads.get(replica, empty).kv_usage > policy.max_kv_usage

    order = sorted(replicas, key=lambda r: (overloaded(r), cost(r)))
    if session_replica in replicas and not overloaded(session_replica):
        shortest = min(loads.get(r, empty).num_queued_tokens for r in replicas)
        if loads.get(session_replica, empty).num_queued_tokens <= shortest + policy.session_slack_tokens:
            order.remove(session_replica)
            order.insert(0, session_replica)
    return [[r] for r in order]
