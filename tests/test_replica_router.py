"""The replica router's Ray-free core (rayvllm/core/replica_router.py):
the per-replica prefix index as reports and routed requests feed it, and
the ranking by queued work plus uncached prompt, with session affinity."""

from __future__ import annotations

from rayvllm.core.replica_router import (
    InflightTally,
    RecentRoutes,
    ReplicaLoad,
    ReplicaPrefixIndex,
    RoutingPolicy,
    SessionTable,
    rank_replicas,
)
from rayvllm.messages.block_hash import hash_request_tokens, routing_key

POLICY = RoutingPolicy(block_size=4, max_kv_usage=0.9, session_slack_tokens=32)


def _keys(tokens: list[int]) -> list[bytes]:
    return [routing_key(h) for h in hash_request_tokens(4, tokens)]


def test_index_walks_each_replicas_chain_from_the_first_block() -> None:
    doc = list(range(100, 124))  # 6 blocks
    keys = _keys(doc)
    index = ReplicaPrefixIndex()
    index.replace("a", keys[:4])
    index.replace("b", keys[:2] + keys[3:])  # holds blocks 3.. but not block 2: its chain breaks there
    assert index.prefix_hits(keys, ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    # A report replaces what the replica held: block 0 evicted ends every walk there.
    index.replace("a", keys[1:4])
    assert index.prefix_hits(keys, ["a"]) == {"a": 0}
    # A routed request's blocks count at once, before the replica reports them.
    index.add("a", keys)
    assert index.prefix_hits(keys, ["a", "b"]) == {"a": 6, "b": 2}
    index.forget("b")
    assert index.replicas == ["a"] and index.prefix_hits(keys, ["b"]) == {"b": 0}
    index.forget("a")
    assert index.num_blocks("a") == 0 and index._holders == {}


def test_the_longest_hit_wins_among_equal_loads_and_ties_go_to_fewer_running() -> None:
    loads = {"a": ReplicaLoad(num_running=2), "b": ReplicaLoad(num_running=1), "c": ReplicaLoad(num_running=1)}
    assert rank_replicas(["a", "b", "c"], 40, {"a": 8, "b": 2}, loads, POLICY) == [["a"], ["b"], ["c"]]
    assert rank_replicas(["a", "b", "c"], 40, {}, loads, POLICY) == [["b"], ["c"], ["a"]]


def test_at_equal_cost_the_replica_holding_the_prefix_wins() -> None:
    """A 40-token prompt whose 32 cached tokens sit behind 32 queued ones on
    `b` costs what it costs on the idle `a`; the prefix wins the tie (even
    against fewer running requests and an earlier id)."""
    loads = {"a": ReplicaLoad(num_running=0), "b": ReplicaLoad(num_running=3, num_queued_tokens=32)}
    assert rank_replicas(["a", "b"], 40, {"b": 8}, loads, POLICY)[0] == ["b"]


def test_a_hot_prefix_spills_once_its_replicas_queue_outweighs_the_hit() -> None:
    hits = {"a": 8}  # 32 of the 40 prompt tokens cached on a
    busy = {"a": ReplicaLoad(num_queued_tokens=31), "b": ReplicaLoad()}
    assert rank_replicas(["a", "b"], 40, hits, busy, POLICY)[0] == ["a"]  # 31 + 8 < 40
    busier = {"a": ReplicaLoad(num_queued_tokens=33), "b": ReplicaLoad()}
    assert rank_replicas(["a", "b"], 40, hits, busier, POLICY)[0] == ["b"]  # 33 + 8 > 40


def test_the_last_prompt_token_is_always_computed() -> None:
    # A 16-token prompt fully cached as 4 blocks still computes its last token.
    loads = {"a": ReplicaLoad(num_queued_tokens=1), "b": ReplicaLoad()}
    assert rank_replicas(["a", "b"], 16, {"a": 4}, loads, POLICY)[0] == ["a"]  # 1 + 1 < 16


def test_an_overloaded_replica_goes_last_whatever_it_holds() -> None:
    loads = {"a": ReplicaLoad(kv_usage=0.95), "b": ReplicaLoad(num_queued_tokens=500)}
    assert rank_replicas(["a", "b"], 40, {"a": 9}, loads, POLICY) == [["b"], ["a"]]


def test_a_session_stays_on_its_replica_within_the_slack() -> None:
    loads = {"a": ReplicaLoad(num_queued_tokens=30), "b": ReplicaLoad()}
    assert rank_replicas(["a", "b"], 40, {"b": 9}, loads, POLICY, session_replica="a")[0] == ["a"]
    loads = {"a": ReplicaLoad(num_queued_tokens=40), "b": ReplicaLoad()}  # 40 > 0 + 32: overloaded for it
    assert rank_replicas(["a", "b"], 40, {"b": 9}, loads, POLICY, session_replica="a")[0] == ["b"]
    # A session whose replica is gone (not among the candidates) routes as any request.
    assert rank_replicas(["b"], 40, {}, {}, POLICY, session_replica="a") == [["b"]]


def test_a_routes_blocks_outlive_reports_until_one_taken_after_it_ended() -> None:
    """A report that predates a request's prefill (or its end) does not
    drop the request's blocks; the first report taken after its end (past
    the clock skew) does, as does age for a request whose end never comes."""
    recent = RecentRoutes(clock_skew_s=1.0, max_age_s=300.0)
    a, b = [b"a" * 8], [b"b" * 8]
    recent.add("r1", "req-a", a, now=0.0)
    recent.add("r1", "req-b", b, now=1.0)
    recent.add("r2", "req-c", a, now=1.0)
    assert recent.after_report("r1", taken_at=50.0, now=2.0) == [a, b]  # both still running
    recent.ended("req-a", at=100.0)
    recent.ended("unknown", at=100.0)
    assert recent.after_report("r1", taken_at=100.5, now=3.0) == [a, b]  # within the skew of its end
    assert recent.after_report("r1", taken_at=101.5, now=4.0) == [b]
    assert recent.after_report("r1", taken_at=500.0, now=400.0) == []  # req-b never ended: too old
    assert len(recent) == 1  # req-c, on r2
    recent.forget("r2")
    assert len(recent) == 0 and recent.after_report("r2", taken_at=0.0, now=0.0) == []


def test_a_sessions_first_choice_holds_its_replica_until_serve_says_where_it_went() -> None:
    """Requests of a new session chosen before the first is routed follow
    the first's choice; where a request went overrides it; a replica that
    left frees its sessions; the least recently used go past capacity."""
    sessions = SessionTable(capacity=2)
    sessions.claim("s", "r1")
    sessions.claim("s", "r2")  # a second request, chosen before the first was routed
    assert sessions.get("s") == "r1"
    sessions.routed("s", "r2")  # Serve fell back to r2 for the first
    assert sessions.get("s") == "r2" and sessions.get(None) is None
    sessions.claim("t", "r1")
    sessions.forget("r2")
    assert sessions.get("s") is None and sessions.get("t") == "r1"
    sessions.routed("u", "r1")
    sessions.routed("v", "r1")
    assert len(sessions) == 2 and sessions.get("t") is None


def test_a_routed_request_counts_until_it_ends_or_a_report_taken_after_it() -> None:
    """A report taken before a request was routed (however late it arrives)
    leaves the request's tokens counted on its replica; one taken after it
    drops them, as does the request's end or its replica leaving."""
    tally = InflightTally(max_age_s=300.0, max_requests=100)
    tally.add("a", "r1", 100, now=10.0)
    tally.add("b", "r1", 40, now=12.0)
    tally.add("c", "r2", 7, now=12.0)
    tally.after_report("r1", taken_at=9.0)  # taken before both: a late arrival
    assert tally.load("r1") == (2, 140)
    tally.after_report("r1", taken_at=11.0)  # covers "a" only
    assert tally.load("r1") == (1, 40)
    tally.ended("b", at=13.0)
    tally.ended("b", at=14.0)  # twice (Serve's word after a report's): counted off once
    assert tally.load("r1") == (0, 0) and tally.load("r2") == (1, 7)
    tally.forget("r2")
    assert tally.load("r2") == (0, 0) and len(tally) == 2  # "a" runs; "b" waits for a report taken after its end


def test_an_ended_requests_queue_comes_off_the_reports_that_counted_it() -> None:
    """A request counted by its replica's report (queued when it was taken)
    that then ends takes its tokens off that report's queue, and off a
    report taken before its end that arrives later, until a report taken
    after its end arrives; a report taken before its routing never counted it."""
    tally = InflightTally(max_age_s=300.0, max_requests=100)
    tally.add("a", "r1", 100, now=10.0)
    tally.after_report("r1", taken_at=11.0)
    tally.ended("a", at=12.0)
    assert tally.load("r1") == (0, -100)
    tally.after_report("r1", taken_at=11.5)  # taken while "a" ran, arriving after it ended
    assert tally.load("r1") == (0, -100)
    tally.after_report("r1", taken_at=12.5)
    assert tally.load("r1") == (0, 0) and len(tally) == 0
    tally.add("b", "r1", 30, now=20.0)
    tally.ended("b", at=21.0)  # no report has counted it yet
    assert tally.load("r1") == (0, 0)
    tally.after_report("r1", taken_at=20.5)  # one taken while it ran, arriving late, did
    assert tally.load("r1") == (0, -30)
    tally.after_report("r1", taken_at=19.0)  # one taken before it was routed did not
    assert tally.load("r1") == (0, 0) and len(tally) == 1


def test_a_request_whose_end_never_comes_is_dropped_after_max_age() -> None:
    tally = InflightTally(max_age_s=300.0, max_requests=100)
    tally.add("a", "r1", 100, now=10.0)
    tally.after_report("r1", taken_at=20.0)
    assert len(tally) == 1
    tally.after_report("r1", taken_at=311.0)
    assert len(tally) == 0
    tally.ended("a", at=312.0)
    assert tally.load("r1") == (0, 0)


def test_past_max_requests_the_oldest_request_is_dropped() -> None:
    """A replica that never reports keeps no more than `max_requests` of the
    requests sent to it; the oldest go, and their load with them."""
    tally = InflightTally(max_age_s=300.0, max_requests=2)
    for i, tokens in enumerate((10, 20, 40)):
        tally.add(f"r{i}", "a", tokens, now=float(i))
    assert len(tally) == 2 and tally.load("a") == (2, 60)
    tally.ended("r0", at=5.0)  # already dropped: nothing changes
    assert tally.load("a") == (2, 60)
