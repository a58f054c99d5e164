"""`KVAwareRequestRouter` driven through Serve's hooks as Serve's router
drives them (choose, routed, completed, reports as the replicas publish
them), on stand-in replicas: which replica each request is ranked onto
when reports arrive late, before any arrive, and after a replica died."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import pytest

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from rayvllm.core.replica_router import ReplicaLoad, encode_report
from rayvllm.entrypoints.kv_router import KVAwareRequestRouter
from rayvllm.messages.block_hash import full_block_routing_keys

DEPLOYMENT = DeploymentID("llm", "app")
_ids = itertools.count()


@dataclass
class Replica:
    """What the router reads of a Serve replica: its id and its last report."""

    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replica_id = ReplicaID(self.name, DEPLOYMENT)

    def report(self, taken_at: float, queued_tokens: int = 0, keys: list[bytes] | None = None) -> None:
        """Publish a report taken at `taken_at` (wall clock) with a queue of `queued_tokens`."""
        load = ReplicaLoad(num_waiting=int(queued_tokens > 0), num_queued_tokens=queued_tokens)
        self.routing_stats = {**encode_report(load, keys or []), "taken_at": taken_at}


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """The loop Serve's router would run the hooks on (a pending request's future belongs to it)."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


@dataclass
class Clock:
    """The router's wall clock (Serve's `get_curr_time_s`), moved by the test."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def _router(clock: Clock) -> KVAwareRequestRouter:
    router = KVAwareRequestRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, get_curr_time_s=clock
    )
    router.initialize_state(block_size=16)
    return router


def _request(loop: asyncio.AbstractEventLoop, tokens: list[int], session: str | None = None) -> PendingRequest:
    kwargs: dict[str, Any] = {"prompt_token_ids": tokens}
    if session is not None:
        kwargs["session_id"] = session
    n = next(_ids)
    metadata = RequestMetadata(f"r{n}", f"internal-{n}")
    return PendingRequest(args=[], kwargs=kwargs, metadata=metadata, future=loop.create_future())


def _route(router: KVAwareRequestRouter, replicas: list[Replica], request: PendingRequest) -> list[list[str]]:
    """Rank `request` and send it to the first choice, as Serve would; the ranks by name."""
    loop = request.future.get_loop()
    ranks = loop.run_until_complete(router.choose_replicas(replicas, request))  # type: ignore[arg-type]
    router.on_request_routed(request, ranks[0][0].replica_id, None)
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def _doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def test_a_burst_spreads_before_any_report_arrives(loop: asyncio.AbstractEventLoop) -> None:
    """No reports yet: each fresh prompt counts as queued where it was sent,
    so the next goes to the other replica (ties go to the replica id)."""
    router, replicas = _router(Clock()), [Replica("a"), Replica("b")]
    firsts = [_route(router, replicas, _request(loop, _doc(i, 40)))[0] for i in range(4)]
    assert firsts == [["a"], ["b"], ["a"], ["b"]]


def test_a_late_report_does_not_keep_an_ended_requests_queue(loop: asyncio.AbstractEventLoop) -> None:
    """A 96-token document goes to replica a; a report of a taken while it
    was queued (96 tokens) reaches the router only after it ended. Its
    follow-up (the document's first four blocks and a 9-token tail) still
    goes to a, where it costs 9 tokens: the report's queue was the ended
    request's (counted, a cost 96 + 73 - 64 against b's 73 sent it to b)."""
    clock = Clock()
    router, (a, b) = _router(clock), [Replica("a"), Replica("b")]
    doc = _doc(1, 96)
    first = _request(loop, doc)
    assert _route(router, [a, b], first) == [["a"], ["b"]]
    a.report(clock.now + 1, queued_tokens=96)
    clock.now += 2
    router.on_request_completed(a.replica_id, first.metadata.internal_request_id)
    assert _route(router, [a, b], _request(loop, doc[:64] + list(range(9, 18)))) == [["a"]]
    # A report taken after the end shows what a holds and queues; the ended request is off the books.
    a.report(clock.now + 1, queued_tokens=30, keys=full_block_routing_keys(16, doc))
    clock.now += 2
    assert _route(router, [a, b], _request(loop, doc + [7])) == [["a"]]
    assert router._current_loads(["a"])["a"].num_queued_tokens == 30 + 1


def test_an_ended_request_comes_off_only_the_queue_that_counted_it(loop: asyncio.AbstractEventLoop) -> None:
    """Replica a's report counts two queued prompts (96 + 40 tokens); when
    the 96-token one ends its tokens come off that report's queue, no more:
    the 40 still queued keep the next fresh prompt off a."""
    clock = Clock()
    router, (a, b) = _router(clock), [Replica("a"), Replica("b")]
    first = _request(loop, _doc(2, 96))
    assert _route(router, [a, b], first)[0] == ["a"]
    a.report(clock.now + 1, queued_tokens=96 + 40)
    clock.now += 2
    router.on_request_completed(a.replica_id, first.metadata.internal_request_id)
    assert _route(router, [a, b], _request(loop, _doc(3, 40)))[0] == ["b"]
    assert router._current_loads(["a"])["a"].num_queued_tokens == 40


def test_a_session_follows_its_replica_and_moves_when_it_dies(loop: asyncio.AbstractEventLoop) -> None:
    """A session's requests follow its first replica whatever the others'
    loads (within the slack); once that replica has died they go elsewhere."""
    router, (a, b) = _router(Clock()), [Replica("a"), Replica("b")]
    assert _route(router, [a, b], _request(loop, _doc(4, 40), session="s"))[0] == ["a"]
    assert _route(router, [a, b], _request(loop, _doc(5, 40), session="s")) == [["a"]]
    router.on_replica_actor_died(a.replica_id)
    assert _route(router, [b], _request(loop, _doc(6, 40), session="s")) == [["b"]]
