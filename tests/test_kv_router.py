"""KV-aware routing across Serve replicas: the engine's block events (the
core tells its client which blocks it begins and stops caching), the
replica's report built from them, and two replicas behind
`KVAwareRequestRouter` where every follow-up to a prompt lands on the
replica holding it (its exact cached token count says so)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests

from rayvllm import SamplingParams
from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.core.block_events import BlockEventLog
from rayvllm.core.replica_router import decode_report
from rayvllm.messages.block_hash import (
    full_block_routing_keys,
    hash_request_tokens,
    num_hit_blocks,
    prefix_routing_keys,
    routing_key,
)
from rayvllm.messages.outputs import RequestOutputKind

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _h(n: int) -> bytes:
    return bytes([n]) * 32


def test_block_events_report_each_key_once_across_ranks() -> None:
    log = BlockEventLog(num_ranks=2)
    first = log.drain()
    assert (first.stored, first.evicted, first.reset) == ([], [], True)
    log.cached(0, _h(1))
    log.cached(1, _h(1))  # another rank: no new event
    log.cached(1, _h(2))
    log.evicted(1, _h(2))  # stored and evicted within one push: nothing to tell
    events = log.drain()
    assert (events.stored, events.evicted, events.reset) == ([routing_key(_h(1))], [], False)
    log.evicted(0, _h(1))
    assert log.drain().evicted == []  # rank 1 still holds it
    log.clear_rank(1)  # rank 1's pool replaced by an empty one
    assert log.drain().evicted == [routing_key(_h(1))]


def _engine(model: Path) -> Any:
    return async_llm_from_engine_args(
        EngineArgs(model=str(model), max_num_seqs=4, max_model_len=256, kv_cache_memory_bytes=8 << 20)
    )


async def _complete(engine: Any, prompt: list[int], request_id: str) -> None:
    async for _ in engine.generate({"prompt_token_ids": prompt}, GREEDY, request_id,
                                   output_kind=RequestOutputKind.FINAL_ONLY):
        pass


def _report_after(model_dir: Path, prompt: list[int]) -> tuple[Any, list[bytes]]:
    """A fresh engine's routing report (load, block keys) after it served `prompt`."""

    async def main() -> dict:
        engine = _engine(model_dir)
        try:
            await _complete(engine, prompt, "r")
            return engine.routing_report()
        finally:
            engine.shutdown()

    return decode_report(asyncio.run(main()))


def test_an_engines_report_names_exactly_the_blocks_it_caches(tiny_model_dir: Path) -> None:
    """Through the engine loop and its client: after a 40-token prompt the
    report holds its two full 16-token blocks' keys, and the load."""
    prompt = [random.Random(3).randrange(5, 4000) for _ in range(40)]
    load, keys = _report_after(tiny_model_dir, prompt)
    # 44 tokens were computed (prompt and outputs but the last): two full blocks of the prompt.
    expected = [routing_key(h) for h in hash_request_tokens(16, (prompt + [0] * 4)[:32])]
    assert sorted(keys) == sorted(expected[:2]) and load.num_running == 0 and load.num_queued_tokens == 0


def test_the_router_records_every_prompt_block_the_engine_then_holds(tiny_model_dir: Path) -> None:
    """A prompt of exactly four blocks: after it is served the engine holds
    all four (the last token's block too), and that is what the router
    records for the replica it sent the prompt to; a lookup of the same
    prompt can hit only the first three (its last token is always computed)."""
    prompt = [random.Random(5).randrange(5, 4000) for _ in range(64)]
    _, held = _report_after(tiny_model_dir, prompt)
    recorded = full_block_routing_keys(16, prompt)
    assert len(recorded) == 4 and set(recorded) <= set(held)
    assert prefix_routing_keys(16, prompt) == recorded[:num_hit_blocks(16, len(prompt))] == recorded[:3]


def test_a_replicas_queue_counts_only_the_prompt_tokens_it_has_not_cached(tiny_model_dir: Path) -> None:
    """Admitted and not yet prefilled: a follow-up whose 64-token prefix the
    engine caches counts its 9 new tokens, a new 40-token prompt all 40 (a
    replica full of hitting follow-ups is not busy)."""
    rng = random.Random(4)
    doc = [rng.randrange(5, 4000) for _ in range(64)]
    fresh = [rng.randrange(5, 4000) for _ in range(40)]

    async def main() -> int:
        engine = _engine(tiny_model_dir)
        try:
            await _complete(engine, doc, "a")
            streams = [engine.add_request({"prompt_token_ids": doc + list(range(9, 18))}, GREEDY, "b"),
                       engine.add_request({"prompt_token_ids": fresh}, GREEDY, "c")]
            queued = engine.load().num_queued_tokens  # before the loop runs: both still queued
            for stream in streams:
                async for _ in stream:
                    pass
            assert engine.load().num_queued_tokens == 0
            return queued
        finally:
            engine.shutdown()

    assert asyncio.run(main()) == 9 + 40


ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402
import ray_state  # noqa: E402

from rayvllm.entrypoints.serve_builder import build_app  # noqa: E402


API_KEY = "kvr-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_KEY = "kvr-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def two_replicas(serve_local: str, tiny_model_dir: Path) -> Iterator[tuple[serve.handle.DeploymentHandle, str]]:
    """Two replicas behind the router ingress: its handle, and its URL through Serve's proxy."""
    # Serve replaces the killed router ingress after its next health check: soon, here.
    args = dict(model=str(tiny_model_dir), max_num_seqs=4, max_model_len=1100, kv_cache_memory_bytes=8 << 20,
                num_replicas=2, api_key=API_KEY, health_check_period_s=1, enable_control_plane=True,
                admin_api_key=ADMIN_KEY)
    try:
        yield serve.run(build_app(args), name="kvr", route_prefix="/kvr"), f"{serve_local}/kvr"
    finally:
        serve.delete("kvr")


def test_every_follow_up_lands_on_the_replica_holding_its_prefix(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """Six 64-token documents, each sent once and then with a 9-token tail
    (Python handle calls, through the ingress): each follow-up is served
    from its document's four cached blocks (a router blind to the cache
    would miss half of them)."""
    handle, _ = two_replicas
    rng = random.Random(11)
    for _ in range(6):
        doc = [rng.randrange(5, 4000) for _ in range(64)]
        first = handle.generate.remote({"prompt_token_ids": doc}, GREEDY).result()
        assert first.num_cached_tokens == 0
        again = handle.generate.remote({"prompt_token_ids": doc + list(range(9, 18))}, GREEDY).result()
        assert again.num_cached_tokens == 64


def _cached(usage: dict) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def _stream(url: str, body: dict) -> tuple[str, dict]:
    """A streamed completion's text and final usage, read as a client would."""
    text, usage = "", {}
    with requests.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                       headers=AUTH, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            usage = chunk.get("usage") or usage
    return text, usage


def test_http_follow_ups_land_on_the_replica_holding_their_prefix(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """Through Serve's proxy and the router ingress: text prompts, token-id
    prompts and streams, each follow-up served from its document's cached
    blocks, and a stream's text the same as the whole answer's."""
    _, url = two_replicas
    rng = random.Random(12)
    for i in range(4):
        doc = [rng.randrange(5, 4000) for _ in range(64)]
        body = {"prompt": doc, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        first = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
        assert _cached(first["usage"]) == 0
        follow_up = {**body, "prompt": doc + list(range(9, 18))}
        if i % 2:
            text, usage = _stream(f"{url}/v1/completions", follow_up)
            whole = requests.post(f"{url}/v1/completions", json=follow_up, headers=AUTH, timeout=60).json()
            assert text == whole["choices"][0]["text"]
        else:
            usage = requests.post(f"{url}/v1/completions", json=follow_up, headers=AUTH, timeout=60).json()["usage"]
        assert _cached(usage) == 64


def test_http_chat_turns_land_on_the_replica_holding_the_conversation(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """A conversation's next turn is served from the blocks of the one
    before it, as many as its rendered prompt shares with the last (the
    server's own /tokenize says how many)."""
    _, url = two_replicas
    rng = random.Random(13)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    for _ in range(3):
        system = " ".join(rng.choice(words) for _ in range(24))
        turn = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
        body = {"messages": turn, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        reply = requests.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
        assert "choices" in reply, reply
        turn2 = turn + [reply["choices"][0]["message"], {"role": "user", "content": "second question"}]
        again = requests.post(f"{url}/v1/chat/completions", json={**body, "messages": turn2}, headers=AUTH,
                              timeout=60).json()
        tokens = [
            requests.post(f"{url}/tokenize", json={"messages": m}, headers=AUTH, timeout=60).json()["tokens"]
            for m in (turn, turn2)
        ]
        common = next((i for i, (a, b) in enumerate(zip(*tokens)) if a != b), min(map(len, tokens)))
        assert common >= 64
        assert _cached(again["usage"]) == common // 16 * 16


def test_the_ingress_answers_errors_as_one_server_would(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    _, url = two_replicas
    no_key = requests.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    bad = requests.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": -1}, headers=AUTH, timeout=60)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    not_json = requests.post(f"{url}/v1/completions", data=b"{", headers=AUTH, timeout=60)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert requests.get(f"{url}/v1/nothing", headers=AUTH, timeout=60).status_code == 404
    wrong_method = requests.get(f"{url}/v1/completions", headers=AUTH, timeout=60)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert requests.get(f"{url}/health", timeout=60).status_code == 200  # public: no key
    models = requests.get(f"{url}/v1/models", headers=AUTH, timeout=60).json()
    assert models["object"] == "list" and len(models["data"]) == 1


def test_a_body_past_grpcs_default_message_size_reaches_a_server(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """The ingress hands a server the body it read over Serve's gRPC,
    whose messages are capped at 4 MiB by default; a 6 MiB body, under
    `max_request_bytes`, is answered as one server would answer it."""
    _, url = two_replicas
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "user": "u" * (6 << 20)}
    reply = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text[:2000]
    assert reply.json()["usage"]["completion_tokens"] == 2


def _kill(class_name: str) -> None:
    for actor in ray_state.actors(class_name, "ALIVE"):
        os.kill(actor.pid, signal.SIGKILL)


def test_a_restarted_router_rebuilds_its_index_from_the_replicas_reports(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """The router ingress (which holds the router) killed after four
    documents were served at once (so both replicas hold some: the router
    counts what it sent where before the reports do): its replacement knows
    where each one is cached from the replicas' reports alone, and every
    follow-up is a full hit."""
    _, url = two_replicas
    rng = random.Random(14)
    docs = [[rng.randrange(5, 4000) for _ in range(64)] for _ in range(4)]

    def send(doc: list[int]) -> int:
        body = {"prompt": doc, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        return requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code

    with ThreadPoolExecutor(len(docs)) as pool:
        assert list(pool.map(send, docs)) == [200] * len(docs)
    _kill("ServeReplica:kvr:OpenAIRouter")
    deadline = time.monotonic() + 120
    while _health(url) != 200:  # Serve replaces the ingress; the proxy answers 503 meanwhile
        assert time.monotonic() < deadline, "the router ingress was not replaced"
        time.sleep(0.25)
    for doc in docs:
        body = {"prompt": doc + [9, 10, 11], "max_tokens": 2, "temperature": 0}
        usage = requests.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()["usage"]
        assert _cached(usage) == 64


def _health(url: str) -> int:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code
    except requests.RequestException:
        return 0


def _replica_reports() -> list[dict]:
    actors = ray_state.actors("ServeReplica:kvr:LLMServer", "ALIVE")
    return [ray.get(ray.get_actor(a.name, namespace="serve").record_routing_stats.remote()) for a in actors]


def test_routes_that_change_the_engine_reach_every_replica(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """/reset_prefix_cache through the router (with the admin key: the API
    key is refused) empties both replicas' caches: documents cached on
    each are missed after it; a pause through the ingress's handle holds
    on both."""
    handle, url = two_replicas
    rng = random.Random(17)
    slow = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)  # long enough to overlap
    docs: list[list[int]] = []
    for _ in range(5):  # documents at once until both replicas hold some (the router spreads a burst)
        burst = [[rng.randrange(5, 4000) for _ in range(64)] for _ in range(8)]
        with ThreadPoolExecutor(len(burst)) as pool:
            list(pool.map(lambda d: handle.generate.remote({"prompt_token_ids": d}, slow).result(), burst))
        docs += burst
        if all(decode_report(r)[1] for r in _replica_reports()):
            break
    assert all(decode_report(r)[1] for r in _replica_reports())
    assert requests.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 401
    assert requests.post(f"{url}/reset_prefix_cache", headers=AUTH, timeout=60).status_code == 401
    assert requests.post(f"{url}/reset_prefix_cache", headers=ADMIN, timeout=60).status_code == 200
    for doc in docs:
        assert handle.generate.remote({"prompt_token_ids": doc + [9, 10]}, GREEDY).result().num_cached_tokens == 0
    handle.pause_generation.remote("keep").result()
    try:
        assert handle.is_paused.remote().result() is True
    finally:
        handle.resume_generation.remote().result()
    assert handle.is_paused.remote().result() is False


def _live_servers() -> list[tuple[int, Any]]:
    """The server replicas alive now: each one's pid and actor handle."""
    return [(a.pid, ray.get_actor(a.name, namespace="serve"))
            for a in ray_state.actors("ServeReplica:kvr:LLMServer", "ALIVE")]


def _kill_the_busy_server(servers: list[tuple[int, Any]]) -> int:
    """SIGKILL the one server replica of `servers` running requests now;
    their number. Every server is asked at once and the busy one killed as
    soon as its answer comes: the streams run on meanwhile, and a server an
    earlier test killed may still be starting again (its answer can take
    seconds, by which time the streams would have ended)."""
    asked = {handle.record_routing_stats.remote(): pid for pid, handle in servers}
    busy: list[tuple[int, int]] = []
    waiting = list(asked)
    while waiting:
        (answer,), waiting = ray.wait(waiting, num_returns=1)
        try:
            report = ray.get(answer)
        except ray.exceptions.RayTaskError as e:
            # The replacement of a server an earlier test killed, still
            # starting: it runs nothing.
            if "initialize_callable" not in str(e):
                raise
            continue
        running = decode_report(report)[0].num_running
        if running:
            if not busy:
                os.kill(asked[answer], signal.SIGKILL)
            busy.append((asked[answer], running))
    assert len(busy) == 1, busy
    return busy[0][1]


Reader = Callable[[threading.Barrier], list[Any]]


def _http_reader(url: str, body: dict) -> Reader:
    """A streamed completion through the router (session "moving"): its
    events as the client reads them, waiting at the barrier after the first."""

    def read(barrier: threading.Barrier) -> list[Any]:
        headers = {**AUTH, "x-session-id": "moving"}
        with requests.post(f"{url}/v1/completions", json=body, headers=headers, stream=True, timeout=120) as r:
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith(b"data: "))
            events: list[Any] = [next(lines)]
            barrier.wait(timeout=60)
            events.extend(lines)
        return events

    return read


def _streams_cut_by_a_kill(readers: list[Reader]) -> tuple[int, list[list[Any]]]:
    """The readers' streams (one session, so one server), that server
    killed once each has its first part: how many requests it was running,
    and what each reader read."""
    # Listed (and their handles found) before the streams start: on a busy
    # machine that can take seconds, in which the streams would run on (and
    # may end).
    servers = _live_servers()
    barrier = threading.Barrier(len(readers) + 1)
    with ThreadPoolExecutor(len(readers)) as pool:
        reads = [pool.submit(read, barrier) for read in readers]
        barrier.wait(timeout=60)
        running = _kill_the_busy_server(servers)
        return running, [f.result() for f in reads]


# Long enough that the kill lands mid-stream (the server reports them running).
LONG = {"prompt": "Once upon a time in a land far away", "max_tokens": 1000, "ignore_eos": True}


def test_a_stream_whose_server_dies_moves_to_another_unbroken(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """A greedy and a seeded HTTP stream and a greedy handle stream on one
    server, killed (SIGKILL) mid-way: each moves to the other server and its
    client reads one unbroken stream, one id, its text, tokens and usage
    equal to an undisturbed run's."""
    handle, url = two_replicas
    bodies = [{**LONG, "temperature": 0}, {**LONG, "temperature": 0.9, "seed": 5}]
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(20, 40))}
    undisturbed = handle.generate.remote(prompt, params)  # the three at once: one batch's time
    with ThreadPoolExecutor(len(bodies)) as pool:
        expected = list(pool.map(
            lambda b: requests.post(f"{url}/v1/completions", json=b, headers=AUTH, timeout=120).json(), bodies
        ))
    whole = undisturbed.result()

    def read_handle(barrier: threading.Barrier) -> list[Any]:
        parts = iter(handle.options(stream=True).generate_stream.remote(prompt, params, session_id="moving"))
        outs = [next(parts)]
        barrier.wait(timeout=60)
        outs.extend(parts)
        return outs

    streamed = [{**b, "stream": True, "stream_options": {"include_usage": True}} for b in bodies]
    running, reads = _streams_cut_by_a_kill([*(_http_reader(url, b) for b in streamed), read_handle])
    assert running == 3
    for events, undisturbed in zip(reads, expected):
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks[-3:]
        assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == undisturbed["choices"][0]["text"]
        assert len({c["id"] for c in chunks}) == 1
        usage = chunks[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            undisturbed["usage"]["prompt_tokens"], undisturbed["usage"]["completion_tokens"]
        )
    outs = reads[-1]
    assert [t for o in outs for t in o.outputs[0].token_ids] == whole.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in outs) == whole.outputs[0].text
    assert outs[-1].finished


def test_a_stream_that_cannot_move_ends_with_an_error_event(
    two_replicas: tuple[serve.handle.DeploymentHandle, str],
) -> None:
    """Two choices (which another server could not rebuild mid-way): the
    server killed under it, the client gets the in-band error event a
    failing engine sends, then [DONE], not a cut connection."""
    _, url = two_replicas
    _, (events,) = _streams_cut_by_a_kill([_http_reader(url, {**LONG, "n": 2, "temperature": 0, "stream": True})])
    assert json.loads(events[0][6:])["choices"]
    assert events[-1] == b"data: [DONE]"
    last = json.loads(events[-2][6:])
    assert "error" in last, f"no error event: the stream ended as if its server lived on: {events[-3:]}"
    error = last["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
