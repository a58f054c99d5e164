"""/v1/embeddings of a pooling model under a real `serve run`, through the
official `openai` client: every input form, float and base64 encodings,
usage, vLLM's `normalize`, and the errors (dimensions, and the generation
routes a pooling model does not serve). Vectors equal transformers' mean
of the final hidden states within 1e-4."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

openai = pytest.importorskip("openai")

from serve_harness import app_url  # noqa: E402

from hf_oracle import hf_embedding  # noqa: E402

MODEL = "tiny-embed"
TEXTS = ["Hello, my name is", "The capital of France is a city of light and water"]
TOL = 1e-4
BASE_URL = app_url(__file__)


def serve_app_args(request: pytest.FixtureRequest) -> dict[str, object]:
    """This module's app on the shared server (conftest.serve_apps): a pooling model."""
    return {"model": str(request.getfixturevalue("tiny_model_dir")), "served_model_name": MODEL, "runner": "pooling",
            "pooler_config": {"pooling_type": "MEAN"}, "max_num_seqs": 8, "max_model_len": 512,
            "max_num_batched_tokens": 16, "kv_cache_memory_bytes": 16 << 20}


@pytest.fixture(scope="module")
def client(serve_apps: None) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", max_retries=0)


def _assert_close(got: list[float], model_dir: Path, ids: list[int], normalize: bool = True) -> None:
    want = hf_embedding(model_dir, ids, "MEAN", normalize)
    assert (torch.tensor(got) - want).abs().max().item() < TOL


def test_texts_as_floats(client: "openai.OpenAI", tiny_model_dir: Path, tiny_tokenizer) -> None:
    resp = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    ids = [tiny_tokenizer.encode(t) for t in TEXTS]
    assert [d.index for d in resp.data] == [0, 1]
    for data, prompt in zip(resp.data, ids):
        _assert_close(data.embedding, tiny_model_dir, prompt)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(p) for p in ids)
    assert resp.model == MODEL


def test_base64_is_what_the_client_decodes(client: "openai.OpenAI", tiny_model_dir: Path, tiny_tokenizer) -> None:
    # Without encoding_format the client asks for base64 and decodes it itself.
    resp = client.embeddings.create(model=MODEL, input=TEXTS[0])
    _assert_close(resp.data[0].embedding, tiny_model_dir, tiny_tokenizer.encode(TEXTS[0]))
    # Asked for explicitly, base64 comes back as the client got it: little-endian float32.
    explicit = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64")
    raw = base64.b64decode(explicit.data[0].embedding)
    assert np.frombuffer(raw, dtype="<f4").tolist() == resp.data[0].embedding


def test_token_ids_and_vllm_normalize(client: "openai.OpenAI", tiny_model_dir: Path) -> None:
    prompts = [[5, 6, 7, 8] * 9, [100, 200, 300]]  # the first is chunked (16-token budget)
    batch = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    for data, prompt in zip(batch.data, prompts):
        _assert_close(data.embedding, tiny_model_dir, prompt)
    one = client.embeddings.create(model=MODEL, input=prompts[1], encoding_format="float",
                                   extra_body={"normalize": False})
    _assert_close(one.data[0].embedding, tiny_model_dir, prompts[1], normalize=False)
    assert one.usage.prompt_tokens == 3


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], [99999]]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embedding_requests_name_the_field(serve_apps: None, body: dict, param: str) -> None:
    r = requests.post(f"{BASE_URL}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_generation_routes_refuse_a_pooling_model(serve_apps: None, route: str, body: dict) -> None:
    r = requests.post(f"{BASE_URL}{route}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "does not generate text" in error["message"]


def _success_count() -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{BASE_URL}/metrics", timeout=30).text
    return sum(
        s.value for family in text_string_to_metric_families(text) for s in family.samples
        if s.name == "rayvllm:request_success_total" and s.labels.get("finished_reason") == "stop"
    )


def test_metrics_count_embedding_requests(client: "openai.OpenAI") -> None:
    before = _success_count()
    client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert _success_count() == before + 2  # one engine request per input
