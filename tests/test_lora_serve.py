"""LoRA adapters served over HTTP by a real `serve run`: listed by
/v1/models with their parent, picked by `model`, equal to transformers +
PEFT; loaded and unloaded at run time; bad adapters a 400, unknown names
a 404."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from serve_harness import app_url

from hf_oracle import NUM_NEW
from lora_oracle import peft_greedy

MODEL = "tiny"
PROMPT = [7, 301, 1999, 42, 3000, 18, 77]
BASE_URL = app_url(__file__)
# Loading adapters by server path takes the admin key; the API stays open here.
ADMIN = {"Authorization": "Bearer lora-admin"}


def serve_app_args(request: pytest.FixtureRequest) -> dict[str, object]:
    """This module's app on the shared server (conftest.serve_apps): adapters
    a and b at start, c and wide loadable at run time."""
    adapters = request.getfixturevalue("lora_adapters")
    return {
        "model": str(request.getfixturevalue("tiny_model_dir")), "served_model_name": MODEL, "enable_lora": True,
        "max_loras": 2, "max_lora_rank": 16, "lora_modules": f"a={adapters['a']} b={adapters['b']}",
        "allow_runtime_lora_updating": True, "admin_api_key": "lora-admin", "max_num_seqs": 8, "max_model_len": 512,
        "kv_cache_memory_bytes": 16 << 20,
    }


def _complete(model: str, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(
        f"{BASE_URL}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": NUM_NEW, "temperature": 0.0, "ignore_eos": True},
        headers=headers, timeout=120,
    )


def _expected_text(model_dir: Path, adapter: Path | None, tokenizer) -> str:
    return tokenizer.decode(peft_greedy(model_dir, adapter, PROMPT), skip_special_tokens=True)


def test_models_lists_adapters_with_their_parent(serve_apps: None) -> None:
    cards = {c["id"]: c for c in requests.get(f"{BASE_URL}/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {MODEL, "a", "b"}
    assert cards["a"]["parent"] == cards["b"]["parent"] == MODEL
    assert cards[MODEL]["parent"] is None


def test_model_name_picks_the_adapter(
    serve_apps: None, tiny_model_dir: Path, lora_adapters: dict[str, Path], tiny_tokenizer
) -> None:
    texts = {}
    for model, adapter in ((MODEL, None), ("a", lora_adapters["a"]), ("b", lora_adapters["b"])):
        resp = _complete(model)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == model
        texts[model] = resp.json()["choices"][0]["text"]
        assert texts[model] == _expected_text(tiny_model_dir, adapter, tiny_tokenizer)
    assert len(set(texts.values())) == 3
    # Serve's multiplexing header, as a client routing by adapter sends it.
    routed = _complete("a", headers={"serve_multiplexed_model_id": "a"})
    assert routed.status_code == 200 and routed.json()["choices"][0]["text"] == texts["a"]
    assert _complete("nope").status_code == 404


def _admin(route: str, body: dict[str, object], headers: dict[str, str] | None = ADMIN) -> requests.Response:
    return requests.post(f"{BASE_URL}{route}", json=body, headers=headers, timeout=30)


def test_adapters_load_and_unload_at_run_time(
    serve_apps: None, tiny_model_dir: Path, lora_adapters: dict[str, Path], tiny_tokenizer
) -> None:
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    c = {"lora_name": "c", "lora_path": str(lora_adapters["c"])}
    for route in (load, unload):
        assert _admin(route, c, headers=None).status_code == 401
    too_wide = _admin(load, {"lora_name": "wide", "lora_path": str(lora_adapters["wide"])})
    assert too_wide.status_code == 400 and "max_lora_rank=16" in too_wide.json()["error"]["message"]
    missing = _admin(load, {"lora_name": "gone", "lora_path": "/nonexistent"})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    assert _admin(load, {"lora_name": MODEL, "lora_path": str(lora_adapters["c"])}).status_code == 400
    assert _admin(load, c).ok
    resp = _complete("c")
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == _expected_text(tiny_model_dir, lora_adapters["c"], tiny_tokenizer)
    assert _admin(unload, {"lora_name": ["c"]}).status_code == 400
    assert _admin(unload, {"lora_name": "c"}).ok
    assert _admin(unload, {"lora_name": "c"}).status_code == 404
    assert _complete("c").status_code == 404
    assert "c" not in {c["id"] for c in requests.get(f"{BASE_URL}/v1/models", timeout=30).json()["data"]}
