"""The real app under `serve run`, spoken to with the official `openai`
package and raw HTTP: parity with the offline engine, streaming framing,
exact usage, errors, API key, metrics, disconnects and the Python handles.

The server runs with Serve's direct ingress and the tests talk to the
replica's own port: the fast path that `rayvllm serve` uses and the
benchmarks measure. It is this module's own (not the shared server of
conftest.serve_apps): its last tests kill its engine and its replica."""

from __future__ import annotations

import concurrent.futures
import json
import random
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest
import requests

openai = pytest.importorskip("openai")

from rayvllm import LLM, SamplingParams  # noqa: E402
from rayvllm.utils.tokenizer import get_tokenizer  # noqa: E402

from serve_harness import REPO, ServeProcess, held_port, serve_run  # noqa: E402

KEY = "sk-rayvllm-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The control plane is on here, behind a key of its own.
ADMIN_KEY = "sk-rayvllm-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ENGINE = dict(max_num_seqs=8, max_model_len=2048, kv_cache_memory_bytes=32 << 20)
MAX_PENDING = 6
MAX_REQUEST_BYTES = 64 << 10
PROMPT = "The capital of France is"
PORT = held_port(pair=True)
BASE_URL = f"http://127.0.0.1:{PORT}"  # the replica itself (Serve's direct ingress)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    args = [f"{k}={v}" for k, v in ENGINE.items()]
    # `--app-dir` (where the import path is found; the checkout, as the
    # harness runs from there) keeps the fast path: BASE_URL is the replica's.
    proc = serve_run(
        ["--app-dir", ".", "serve_app:build_app", f"model={tiny_model_dir}", "served_model_name=tiny", f"api_key={KEY}",
         "enable_control_plane=true", f"admin_api_key={ADMIN_KEY}",
         f"max_pending_requests={MAX_PENDING}", f"max_request_bytes={MAX_REQUEST_BYTES}",
         # A killed replica is found at the next health check: soon, here.
         "health_check_period_s=1", *args],
        tmp_path_factory.mktemp("serve") / "serve.log",
        port=PORT,
    )
    try:
        proc.wait_ready(headers=AUTH)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model_dir), **ENGINE)
    yield llm
    llm.shutdown()


def _metrics() -> dict[str, float]:
    """Unlabelled view of /metrics: sample name (+ sorted labels except
    model_name) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{BASE_URL}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_completion_matches_offline_engine(client: "openai.OpenAI", offline: LLM, tiny_model_dir: Path) -> None:
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    ref = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(get_tokenizer(tiny_model_dir)(PROMPT).input_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streamed_completion_equals_unstreamed(client: "openai.OpenAI") -> None:
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_return_token_ids_over_http(client: "openai.OpenAI", offline: LLM) -> None:
    """Token-in/token-out (vLLM's `return_token_ids`): the ids sent are the
    prompt's, the ids back the offline engine's, whole or streamed."""
    rng = random.Random("token-ids")
    prompt_ids = [rng.randrange(5, 4000) for _ in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=10)
    ref = offline.generate([{"prompt_token_ids": prompt_ids}], greedy, use_tqdm=False)[0]
    kwargs = dict(model="tiny", prompt=prompt_ids, max_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs).model_dump()["choices"][0]
    assert whole["prompt_token_ids"] == prompt_ids
    assert whole["token_ids"] == list(ref.outputs[0].token_ids)
    chunks = [c.model_dump()["choices"][0] for c in client.completions.create(stream=True, **kwargs)]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["token_ids"]] == list(ref.outputs[0].token_ids)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(client: "openai.OpenAI", route: str) -> None:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: 0 for a prompt
    the cache has never seen, then its full 16-token blocks (the last token
    is always computed), streamed or not."""
    rng = random.Random(f"cached-{route}")
    ids = [rng.randrange(5, 4000) for _ in range(40)]
    if route == "completions":
        def call(**kwargs: Any) -> Any:
            return client.completions.create(model="tiny", prompt=ids, max_tokens=2, **kwargs)
    else:
        text = " ".join(str(i) for i in ids)

        def call(**kwargs: Any) -> Any:
            return client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": text}], max_tokens=2, **kwargs
            )
    first = call()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt_tokens = first.usage.prompt_tokens
    assert call().usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    chunks = list(call(stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16


def test_sse_framing_ends_with_done(server: ServeProcess) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with requests.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: "):])["object"] == "text_completion"


def test_chat_matches_offline_engine(client: "openai.OpenAI", offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_sampling_fields_reach_the_engine(client: "openai.OpenAI", offline: LLM) -> None:
    seeded = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9, seed=11, n=2,
                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True})
    a = client.completions.create(**seeded)
    b = client.completions.create(**seeded)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    assert a.usage.completion_tokens == 16
    lp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    assert len(lp.choices[0].logprobs.tokens) == 4
    assert all(len(top) >= 3 for top in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2,
    )
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    stop_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    cut = stop_text[3:6]
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[cut])
    assert stopped.choices[0].finish_reason == "stop" and cut not in stopped.choices[0].text


def test_models_tokenize_detokenize(server: ServeProcess, tiny_model_dir: Path) -> None:
    models = requests.get(f"{BASE_URL}/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 2048
    tok = requests.post(f"{BASE_URL}/tokenize", json={"model": "tiny", "prompt": PROMPT}, headers=AUTH, timeout=10)
    tokenizer = get_tokenizer(tiny_model_dir)
    ids = tokenizer(PROMPT).input_ids
    assert tok.json()["tokens"] == ids and tok.json()["count"] == len(ids)
    detok = requests.post(f"{BASE_URL}/detokenize", json={"model": "tiny", "tokens": ids}, headers=AUTH, timeout=10)
    assert detok.json()["prompt"] == tokenizer.decode(ids) and PROMPT in detok.json()["prompt"]


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": "no-such-model", "prompt": "x"}, 404, None),
        ({"model": "tiny", "prompt": "word " * 3000}, 400, "prompt"),
    ],
)
def test_errors_are_openai_json(server: ServeProcess, body: dict, status: int, param: str | None) -> None:
    r = requests.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_invalid_json_and_api_key(server: ServeProcess) -> None:
    r = requests.post(f"{BASE_URL}/v1/completions", data="{not json", headers=AUTH | {"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.post(f"{BASE_URL}/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(f"{BASE_URL}/v1/models", timeout=10).status_code == 401
    assert requests.get(f"{BASE_URL}/health", timeout=30).status_code == 200


def _stream_until_first_token(session: requests.Session, max_tokens: int) -> tuple[requests.Response, Iterator[bytes]]:
    """An open stream after its first event. The line iterator is returned
    too: once it is garbage collected, requests releases the connection,
    which the server (rightly) takes for a client gone away."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    r = session.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    assert next(lines).startswith(b"data: ")
    return r, lines


def _wait_for_idle_engine(deadline_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + deadline_s
    while True:
        m = _metrics()
        if (m["rayvllm:num_requests_running"], m["rayvllm:num_requests_waiting"], m["rayvllm:kv_cache_usage_perc"]) == (0, 0, 0):
            return m
        assert time.monotonic() < deadline, f"engine still busy: {m}"
        time.sleep(0.2)  # polling an external server's state, not synchronisation


def test_disconnect_aborts_and_frees_blocks(server: ServeProcess) -> None:
    """2,000 tokens (seconds of decoding): the stream cannot end on its own
    before the server sees the client go (200 once did, on a busy machine)."""
    before = _metrics()
    with requests.Session() as session:
        r, _ = _stream_until_first_token(session, max_tokens=2000)
        r.close()  # the client goes away mid-stream
    after = _wait_for_idle_engine()
    key = "rayvllm:request_success_total{finished_reason=abort}"
    assert after[key] == before.get(key, 0) + 1


def test_overload_answers_503(server: ServeProcess) -> None:
    """MAX_PENDING streams opened at once and held; each needs ~2,000 decode
    steps (seconds even on a fast CPU), far longer than opening them takes,
    so the next request finds the engine full."""
    sessions = [requests.Session() for _ in range(MAX_PENDING)]
    try:
        with concurrent.futures.ThreadPoolExecutor(MAX_PENDING) as pool:
            streams = list(pool.map(lambda s: _stream_until_first_token(s, max_tokens=2000), sessions))
        r = requests.post(f"{BASE_URL}/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["Retry-After"] == "1"
        for r, _ in streams:
            r.close()
    finally:
        for s in sessions:
            s.close()
    _wait_for_idle_engine()


def test_a_body_over_the_limit_is_413_declared_or_streamed(server: ServeProcess) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * MAX_REQUEST_BYTES, "max_tokens": 1}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    declared = requests.post(f"{BASE_URL}/v1/completions", data=big, headers=headers, timeout=30)
    # A generator body goes chunked, with no Content-Length to refuse it by.
    chunks = (big[i : i + 8192] for i in range(0, len(big), 8192))
    streamed = requests.post(f"{BASE_URL}/v1/chat/completions", data=chunks, headers=headers, timeout=30)
    for r in (declared, streamed):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == 413
    small = requests.post(f"{BASE_URL}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                          headers=AUTH, timeout=30)
    assert small.status_code == 200


def test_metrics_count_exactly(client: "openai.OpenAI") -> None:
    _wait_for_idle_engine()
    before = _metrics()
    usages = [
        client.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=5 + i, temperature=0,
                                  extra_body={"ignore_eos": True}).usage
        for i in range(3)
    ]
    after = _metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert delta("rayvllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("rayvllm:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 18
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"rayvllm:{hist}_count") == 3
    assert delta("rayvllm:request_success_total{finished_reason=length}") == 3
    assert "rayvllm:prefix_cache_queries_total" in after and "rayvllm:num_preemptions_total" in after


HANDLE_SCRIPT = """
import asyncio, ray
from ray import serve
from rayvllm import SamplingParams
from rayvllm.entrypoints.serve_builder import LLMHandle
ray.init(log_to_driver=False)  # RAY_ADDRESS: the server's cluster
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
long = SamplingParams(temperature=0, max_tokens={stream_tokens}, ignore_eos=True)
handle = serve.get_app_handle("default")
a = handle.generate.remote("{prompt}", params).result()
b = ray.get(LLMHandle().generate.remote("{prompt}", params))
async def stream():
    return [o async for o in handle.options(stream=True).generate_stream.remote("{prompt}", long)]
deltas = asyncio.run(stream())
print(repr((a.outputs[0].text, a.finished, b.outputs[0].text, b.finished,
            "".join(d.outputs[0].text for d in deltas), deltas[-1].finished, len(deltas))))
"""
# The streamed request's length: long enough (a few hundred steps) that a
# replica kept off the CPU by a busy machine still reads more than one of
# its steps as they come, not all of them at once.
STREAM_TOKENS = 480


def test_python_handles(server: ServeProcess, offline: LLM) -> None:
    ref, long = offline.generate(
        [PROMPT, PROMPT],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (48, STREAM_TOKENS)],
        use_tqdm=False,
    )
    out = subprocess.run(
        [sys.executable, "-c", HANDLE_SCRIPT.format(prompt=PROMPT, stream_tokens=STREAM_TOKENS)],
        cwd=REPO, env=os.environ | server.join_env(), capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    a_text, a_done, b_text, b_done, streamed, s_done, n = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307
    text = ref.outputs[0].text
    assert (a_text, a_done, b_text, b_done, streamed, s_done) == (text, True, text, True, long.outputs[0].text, True)
    # It really streamed. Outputs that arrive while the reader is busy are
    # joined into one delta, but the reader waits on the first step (the
    # prompt's), which carries one token of the STREAM_TOKENS.
    assert n > 1


def test_concurrent_clients_all_match(client: "openai.OpenAI", offline: LLM) -> None:
    prompts = [f"{PROMPT} number {i}" for i in range(6)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(
            lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text,
            prompts,
        ))
    assert texts == [r.outputs[0].text for r in refs]


RL_ROUTES = ["/reset_prefix_cache", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
             "/finish_weight_update", "/pause", "/resume", "/sleep", "/wake_up"]


def _http_sync(weights: dict[str, Any]) -> None:
    """A trainer in this process (rank 0 of a gloo group on a free port)
    drives the replica's engine through the four weight-transfer routes."""
    from rayvllm.distributed.weight_transfer import TransferGroup
    from rayvllm.messages.weight_update import WeightUpdateInfo
    from rayvllm.utils.network import free_port

    port = free_port()
    init = {"init_info": {"backend": "gloo", "master_address": "127.0.0.1", "master_port": port, "world_size": 2}}
    info = WeightUpdateInfo.of(weights)
    update = {"update_info": {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            requests.post, f"{BASE_URL}/init_weight_transfer_engine", json=init, headers=ADMIN, timeout=120
        )
        group = TransferGroup("gloo", "127.0.0.1", port, 0, 2)
        assert joined.result().status_code == 200
        assert requests.post(f"{BASE_URL}/start_weight_update", headers=ADMIN, timeout=60).status_code == 200
        received = pool.submit(requests.post, f"{BASE_URL}/update_weights", json=update, headers=ADMIN, timeout=120)
        group.send(weights)
        assert received.result().status_code == 200
    assert requests.post(f"{BASE_URL}/finish_weight_update", headers=ADMIN, timeout=120).status_code == 200


def test_control_plane_routes_need_the_admin_key_pause_and_sync_weights_over_gloo(
    server: ServeProcess, client: "openai.OpenAI", tiny_model_dir: Path, tmp_path: Path
) -> None:
    from rl_oracle import save_weights, trained_weights

    for route in RL_ROUTES:
        assert requests.post(f"{BASE_URL}{route}", json={}, timeout=30).status_code == 401
        # The API key lets a client generate, not change the server.
        assert requests.post(f"{BASE_URL}{route}", json={}, headers=AUTH, timeout=30).status_code == 401
    for route in ("/is_paused", "/is_sleeping"):
        assert requests.get(f"{BASE_URL}{route}", headers=AUTH, timeout=30).status_code == 401
        assert requests.get(f"{BASE_URL}{route}", headers=ADMIN, timeout=30).json() == {route[1:]: False}
    # The admin key is a client's key too.
    assert requests.get(f"{BASE_URL}/v1/models", headers=ADMIN, timeout=30).status_code == 200
    for route, body, paused in (("/pause", {"mode": "keep"}, True), ("/resume", None, False)):
        assert requests.post(f"{BASE_URL}{route}", json=body, headers=ADMIN, timeout=30).status_code == 200
        assert requests.get(f"{BASE_URL}/is_paused", headers=ADMIN, timeout=30).json() == {"is_paused": paused}
    r = requests.post(f"{BASE_URL}/reset_prefix_cache", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and r.json() == {"reset": True}
    for route, body, asleep in (("/sleep", {"level": 1}, True), ("/wake_up", {}, False)):
        assert requests.post(f"{BASE_URL}{route}", json=body, headers=ADMIN, timeout=60).status_code == 200
        assert requests.get(f"{BASE_URL}/is_sleeping", headers=ADMIN, timeout=30).json() == {"is_sleeping": asleep}
    bad = requests.post(f"{BASE_URL}/init_weight_transfer_engine", json={"init_info": {"backend": "ray"}},
                        headers=ADMIN, timeout=30)
    assert bad.status_code == 400
    trained = trained_weights(tiny_model_dir, seed=3)
    fresh = LLM(model=str(save_weights(tiny_model_dir, trained, tmp_path / "trained")), **ENGINE)
    expected = fresh.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    fresh.shutdown()

    def served() -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text

    before = served()
    _http_sync(trained)
    assert served() == expected != before
    _http_sync(trained_weights(tiny_model_dir, seed=3, scale=0.0))  # back, for the tests after this one
    assert served() == before
    # The handle takes an object ref the caller put once (the ray backend).
    out = subprocess.run(
        [sys.executable, "-c", SYNC_SCRIPT.format(trained=tmp_path / "trained", original=tiny_model_dir, prompt=PROMPT)],
        cwd=REPO, env=os.environ | server.join_env(), capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert eval(out.stdout.strip().splitlines()[-1]) == (expected, before)  # noqa: S307


def test_a_weight_transfer_group_that_never_forms_holds_no_request(server: ServeProcess, offline: LLM) -> None:
    """The issue's one POST that took the server down: an init whose group
    cannot form. A group missing a member waits while /v1 serves (and
    Serve's health checks pass: the replica is the same afterwards), and
    answers once the member joins; a group whose host never answers is a
    400 naming the address and timeout_s after a bounded wait."""
    from rayvllm.distributed.weight_transfer import TransferGroup
    from rayvllm.utils.network import free_port

    replicas = server.descendant_pids("ray::ServeReplica")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = offline.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    port = free_port()
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": port, "world_size": 3, "timeout_s": 120}}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # The trainer (rank 0) and the engine (rank 1) wait for rank 2.
        trainer = pool.submit(TransferGroup, "gloo", "127.0.0.1", port, 0, 3, 120.0)
        joined = pool.submit(requests.post, f"{BASE_URL}/init_weight_transfer_engine", json=init, headers=ADMIN,
                             timeout=150)
        for _ in range(3):
            r = requests.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
        assert not joined.done()  # rank 2 has not joined: the group cannot have formed
        busy = requests.post(f"{BASE_URL}/start_weight_update", headers=ADMIN, timeout=60)
        assert busy.status_code == 400 and "init_weight_transfer_engine" in busy.json()["error"]["message"]
        last = pool.submit(TransferGroup, "gloo", "127.0.0.1", port, 2, 3, 120.0)
        assert joined.result().status_code == 200
        trainer.result().close()
        last.result().close()
    closed = {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "timeout_s": 2}}
    r = requests.post(f"{BASE_URL}/init_weight_transfer_engine", json=closed, headers=ADMIN, timeout=120)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "127.0.0.1:1" in message and "timeout_s=2" in message and "master_port" in message
    r = requests.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    assert server.descendant_pids("ray::ServeReplica") == replicas


SYNC_SCRIPT = """
import ray, torch
from ray import serve
from transformers import AutoModelForCausalLM
from rayvllm import SamplingParams
ray.init(log_to_driver=False)  # RAY_ADDRESS: the server's cluster
handle = serve.get_app_handle("default")
params = SamplingParams(temperature=0, max_tokens=12)
texts = []
for path in ("{trained}", "{original}"):
    weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    handle.sync_weights.remote(ray.put(weights), backend="ray").result()
    texts.append(handle.generate.remote("{prompt}", params).result().outputs[0].text)
print(repr(tuple(texts)))
"""


def test_killed_engine_costs_no_request(server: ServeProcess, offline: LLM) -> None:
    """It kills the process that runs the model (at TP=PP=DP=1 the
    SchedulerActor hosts the one worker) while a stream is in flight. The
    replica starts a new engine and resumes the request: the stream ends
    normally with the text of an undisturbed run, the server is healthy
    afterwards and /metrics counts the restart."""
    restarts = _metrics().get("rayvllm:engine_restarts_total", 0.0)
    engines = server.descendant_pids("ray::SchedulerActor")
    assert len(engines) == 1, engines
    assert server.descendant_pids("ray::WorkerActor") == []
    # 2,000 tokens: seconds of decoding, so the engine is still generating
    # when the client has read five events and kills it.
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    expected = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].text
    text, events = "", 0
    with requests.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            events += 1
            if events == 5:
                os.kill(engines[0], signal.SIGKILL)
            finish = chunk["choices"][0]["finish_reason"]
    assert finish == "length" and text == expected
    assert requests.get(f"{BASE_URL}/health", timeout=60).status_code == 200
    successors = server.descendant_pids("ray::SchedulerActor")
    assert len(successors) == 1 and successors != engines
    assert _metrics()["rayvllm:engine_restarts_total"] == restarts + 1


def test_killed_replica_is_replaced_and_its_client_gets_an_error(server: ServeProcess) -> None:
    """The LLMServer replica itself is killed while a client streams from it. The client's stream breaks (an error, never a
    hang); Serve starts a new replica, which serves; the old replica's
    engine is gone with it, and only the new one's is left."""
    replicas = server.descendant_pids("ray::ServeReplica")
    assert len(replicas) == 1
    old_engines = server.descendant_pids("ray::SchedulerActor")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with pytest.raises(requests.exceptions.RequestException):
        with requests.post(f"{BASE_URL}/v1/completions", json=body, headers=AUTH, stream=True, timeout=120) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i == 2:
                    os.kill(replicas[0], signal.SIGKILL)
    deadline = time.monotonic() + 240
    while True:
        try:
            if requests.get(f"{BASE_URL}/health", timeout=10).status_code == 200:
                break
        except requests.exceptions.ConnectionError:
            pass
        assert time.monotonic() < deadline, "no healthy replica after the kill"
        time.sleep(0.5)  # polling an external server's state, not synchronisation
    r = requests.post(f"{BASE_URL}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3},
                      headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    new_replicas = server.descendant_pids("ray::ServeReplica")
    assert len(new_replicas) == 1 and new_replicas != replicas
    engines = server.descendant_pids("ray::SchedulerActor")
    assert len(engines) == 1 and not set(engines) & set(old_engines)
