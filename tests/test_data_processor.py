"""Batch inference over Ray Data (rayvllm.data): every input row comes out
once, in order, with its columns kept; greedy, seeded, structured (choice)
and LoRA rows equal the offline `LLM`'s tokens; an invalid row fails alone
(or fails the job); a replica whose process is killed mid-job (SIGKILL, by
pid, once it has admitted a known number of rows) leaves a complete and
exact output; a preprocess runs in the engine stage and a postprocess skips
failed rows; `embed` equals `LLM.embed`; a replica runs a TP=2 engine on
Ray; a replica's engine metrics reach Ray's Prometheus endpoint. One shared
Ray cluster (`ray_local`)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import ray_state
from process_state import thread_niceness
import requests
from ray.data import DataContext

from rayvllm import LLM, PoolingParams, SamplingParams
from rayvllm.actors.niceness import may_lower_niceness
from rayvllm.data import ERROR_COLUMN, EngineProcessorConfig, build_processor
from rayvllm.data.replica import REPLICA_NAME_PREFIX, ReplicaPlacement, start_replica
from rayvllm.data.rows import request_fields
from rayvllm.messages.lora_request import LoRARequest
from rayvllm.messages.structured_outputs import StructuredOutputsParams

ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=256, max_num_seqs=8)
CHAT = [{"role": "user", "content": "Say something."}]
CHOICES = ["yes", "no", "maybe later"]


def _rows() -> list[dict[str, Any]]:
    """Token-id prompts (greedy, and one seeded sample), text prompts, a
    chat and a structured output (a choice)."""
    rng = random.Random(3)
    rows: list[dict[str, Any]] = []
    for i in range(14):
        ids = [rng.randrange(5, 4000) for _ in range(rng.randint(3, 40))]
        params = {"temperature": 0.0, "max_tokens": 4 + i % 5}
        rows.append({"id": i, "prompt_token_ids": ids, "sampling_params": params})
    rows[6]["sampling_params"] = {"temperature": 1.0, "seed": 7, "max_tokens": 6}
    rows.append({"id": 14, "prompt": "Hello, my name is", "sampling_params": {"temperature": 0.0, "max_tokens": 5}})
    rows.append({"id": 15, "messages": CHAT, "sampling_params": {"temperature": 0.0, "max_tokens": 5}})
    rows.append({"id": 16, "prompt": "Answer:", "sampling_params": {"temperature": 0.0, "max_tokens": 16,
                 "structured_outputs": {"choice": CHOICES}}})
    return rows


def _offline_request(row: dict[str, Any]) -> tuple[Any, SamplingParams]:
    given = dict(row["sampling_params"])
    if "structured_outputs" in given:
        given["structured_outputs"] = StructuredOutputsParams(**given["structured_outputs"])
    return row.get("prompt") or {"prompt_token_ids": row["prompt_token_ids"]}, SamplingParams(**given)


# A row that names LoRA adapter "a" (Ray Data LLM's `model` column), on an engine with LoRA on.
LORA_ENGINE: dict[str, Any] = dict(enable_lora=True, max_loras=1, max_lora_rank=16)
LORA_ROW: dict[str, Any] = {"id": 17, "prompt_token_ids": [7, 8, 9, 10], "model": "a",
                            "sampling_params": {"temperature": 0.0, "max_tokens": 6}}


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, lora_adapters: dict[str, Path]) -> dict[int, list[int]]:
    """Each row's tokens from the offline engine, by id (LORA_ROW's with its adapter)."""
    rows = _rows()
    llm = LLM(str(tiny_model_dir), **ENGINE, **LORA_ENGINE)
    try:
        plain = [r for r in rows if "messages" not in r]
        requests = [_offline_request(r) for r in plain]
        outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        [chat] = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        prompt, params = _offline_request(LORA_ROW)
        [adapted] = llm.generate(prompt, params, use_tqdm=False,
                                 lora_request=LoRARequest("a", 1, str(lora_adapters["a"])))
    finally:
        llm.shutdown()
    tokens = {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(plain, outs)}
    tokens[15] = list(chat.outputs[0].token_ids)
    tokens[LORA_ROW["id"]] = list(adapted.outputs[0].token_ids)
    return tokens


@pytest.fixture(scope="module")
def ordered() -> Iterator[None]:
    """Ray Data keeps the input's order (for the order checks)."""
    options = DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, True
    yield
    options.preserve_order = before


def _config(model_dir: Path, engine: dict[str, Any] | None = None, **fields: Any) -> EngineProcessorConfig:
    return EngineProcessorConfig(
        model_source=str(model_dir), engine_kwargs={**ENGINE, **(engine or {})}, batch_size=4, **fields
    )


@pytest.fixture(scope="module")
def generated_job(
    ray_local: None, ordered: None, tiny_model_dir: Path, lora_adapters: dict[str, Path]
) -> tuple[list[dict[str, Any]], str]:
    """The rows, one invalid one (id 99) and LORA_ROW, through two replicas
    that go on after errors, with a preprocess and a postprocess; the
    output rows and the job's stats."""

    # Defined here, so that Ray pickles them by value (the workers cannot import a test module).
    def _tag_input(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "tag": f"in-{row['id']}"}

    def _count_output(row: dict[str, Any]) -> dict[str, Any]:
        return {**row, "tokens_seen": len(row["generated_tokens"])}

    rows = [*_rows(), LORA_ROW]
    rows.insert(5, {"id": 99, "prompt_token_ids": [5, 6], "sampling_params": {"max_tokens": 0}})
    config = _config(
        tiny_model_dir, LORA_ENGINE, concurrency=2, should_continue_on_error=True,
        dynamic_lora_loading_path=str(lora_adapters["a"].parent),
    )
    processor = build_processor(config, preprocess=_tag_input, postprocess=_count_output)
    out = processor(ray.data.from_items(rows)).materialize()
    return out.take_all(), out.stats()


@pytest.fixture(scope="module")
def generated(generated_job: tuple[list[dict[str, Any]], str]) -> list[dict[str, Any]]:
    return generated_job[0]


def test_every_row_once_in_order_with_its_columns(generated: list[dict[str, Any]]) -> None:
    want = [*_rows(), LORA_ROW]
    want.insert(5, {"id": 99})
    assert [r["id"] for r in generated] == [r["id"] for r in want]
    for row, given in zip(generated, want):
        for key, value in given.items():
            # The input's columns come back as they went in (Arrow gives a
            # dict column every key any row's dict has, None where unset).
            got = row[key]
            if isinstance(value, dict):
                got = {k: v for k, v in got.items() if v is not None}
            assert got == value, key


def test_rows_equal_the_offline_engine(
    generated: list[dict[str, Any]], expected: dict[int, list[int]], tiny_tokenizer: Any
) -> None:
    for row in generated:
        if row["id"] == 99:
            continue
        assert row[ERROR_COLUMN] == ""
        assert row["generated_tokens"] == expected[row["id"]], row["id"]
        assert row["num_generated_tokens"] == len(expected[row["id"]])
        assert row["num_input_tokens"] == len(row["prompt_token_ids"])
        assert row["generated_text"] == tiny_tokenizer.decode(row["generated_tokens"], skip_special_tokens=True)
        if row["id"] != 16:
            assert row["finish_reason"] == "length"
    choice = next(r for r in generated if r["id"] == 16)
    assert choice["generated_text"] in CHOICES and choice["finish_reason"] == "stop"
    chat = next(r for r in generated if r["id"] == 15)
    assert chat["prompt"].startswith("<|im_start|>user")  # the chat template's text


def test_an_invalid_row_fails_alone(generated: list[dict[str, Any]]) -> None:
    [bad] = [r for r in generated if r[ERROR_COLUMN]]
    assert bad["id"] == 99 and "max_tokens" in bad[ERROR_COLUMN]
    assert bad["generated_tokens"] == [] and bad["prompt_token_ids"] == [5, 6]


def test_pre_and_postprocess_run_on_each_row_and_the_preprocess_in_the_feeders(
    generated_job: tuple[list[dict[str, Any]], str],
) -> None:
    """The preprocess reaches every row, the postprocess every row but the
    failed one; the preprocess runs inside the engine stage (one fused
    operator), not as a Ray task per input block beside the engine."""
    rows, stats = generated_job
    assert [r["tag"] for r in rows] == [f"in-{r['id']}" for r in rows]
    for row in rows:
        assert row.get("tokens_seen") == (None if row[ERROR_COLUMN] else len(row["generated_tokens"]))
    assert "Map(_tag_input)->MapBatches(ReplicaFeeder)" in stats, stats


def test_an_invalid_row_fails_the_job_by_default(ray_local: None, tiny_model_dir: Path) -> None:
    rows = [{"id": 0, "prompt_token_ids": [5, 6], "sampling_params": {"max_tokens": 2}},
            {"id": 1, "prompt_token_ids": [5, 6], "sampling_params": {"max_tokens": 0}}]
    with pytest.raises(Exception, match="row 1 of the batch failed: InvalidParameterError: max_tokens"):
        build_processor(_config(tiny_model_dir))(ray.data.from_items(rows)).take_all()


def test_a_killed_replica_loses_no_row(
    ray_local: None, ordered: None, tiny_model_dir: Path, expected: dict[int, list[int]]
) -> None:
    """Kill the replica once it has admitted 8 of the 17 rows (at most 4 at
    a time: some have finished, and at least 8 never reached the killed
    engine) for good (`ray.kill` with no restart, as when its restarts are
    spent), and the feeder starts a new replica; kill that one's process
    by pid (SIGKILL) once it has admitted 2, and Ray restarts it. Each time
    the feeder resubmits the unfinished rows, and the output is complete
    and exactly the undisturbed run's."""
    rows = _rows()
    config = _config(tiny_model_dir, concurrency=1, max_pending_requests=4)
    result: list[dict[str, Any]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.extend(build_processor(config)(ray.data.from_items(rows)).take_all())
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            failure.append(e)

    job = threading.Thread(target=run)
    earlier = set(ray.util.list_named_actors())  # a finished job's replicas may still be listed
    job.start()
    replica = _the_replica(job, earlier)
    ray.get(replica.wait_started.remote(8), timeout=120)
    named = set(ray.util.list_named_actors())
    ray.kill(replica, no_restart=True)
    successor = _the_replica(job, named)
    pid = ray.get(successor.wait_started.remote(2), timeout=120)
    # A replica runs its engine at niceness 0, every thread (torch's too),
    # where the machine lets it lower its own (actors/niceness.py).
    levels = thread_niceness(pid)
    assert (levels == {0}) == may_lower_niceness(), levels
    os.kill(pid, signal.SIGKILL)
    job.join(timeout=300)
    assert not job.is_alive() and not failure, failure
    assert [r["id"] for r in result] == [r["id"] for r in rows]
    assert {r["id"]: r["generated_tokens"] for r in result} == {r["id"]: expected[r["id"]] for r in rows}


def _the_replica(job: threading.Thread, earlier: set[str]) -> Any:
    """The one engine replica of the running job, once the job has named it."""
    while job.is_alive():
        names = [n for n in ray.util.list_named_actors() if n.startswith(REPLICA_NAME_PREFIX) and n not in earlier]
        if names:
            [name] = names
            return ray.get_actor(name)
        job.join(timeout=0.05)  # polls for the name; the kill itself waits on the replica's own event
    raise AssertionError("the job ended before it made a replica")


def test_embed_equals_llm_embed(ray_local: None, ordered: None, tiny_model_dir: Path) -> None:
    rows = [r for r in _rows() if "prompt_token_ids" in r][:6]
    for row in rows:
        row["pooling_params"] = {"normalize": row["id"] % 2 == 0}
    llm = LLM(str(tiny_model_dir), task="embed", **ENGINE)
    try:
        want = llm.embed([{"prompt_token_ids": r["prompt_token_ids"]} for r in rows],
                         [PoolingParams(**r["pooling_params"]) for r in rows], use_tqdm=False)
    finally:
        llm.shutdown()
    processor = build_processor(_config(tiny_model_dir, task_type="embed"))
    got = processor(ray.data.from_items(rows)).take_all()
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    for row, out in zip(got, want):
        assert len(row["embeddings"]) == len(out.outputs.embedding)
        assert max(abs(a - b) for a, b in zip(row["embeddings"], out.outputs.embedding)) < 1e-5
        assert row["num_input_tokens"] == len(row["prompt_token_ids"])


def test_a_tensor_parallel_replica(
    ray_local: None, ordered: None, tiny_model_dir: Path, expected: dict[int, list[int]]
) -> None:
    """A replica whose engine has TP=2 makes its own SchedulerActor and two
    worker actors on Ray; greedy rows equal the single-process engine's."""
    rows = [r for r in _rows() if r["sampling_params"].get("temperature") == 0.0][:4]
    config = _config(tiny_model_dir, engine={"tensor_parallel_size": 2})
    got = build_processor(config)(ray.data.from_items(rows)).take_all()
    assert {r["id"]: r["generated_tokens"] for r in got} == {r["id"]: expected[r["id"]] for r in rows}


def test_a_feeder_imports_no_torch() -> None:
    """What a feeder process loads to take batches and start its replica
    (the processor, the replica's class, the engine arguments and the
    parallel layout) leaves torch, and its seconds of import, to the
    replica that runs the model."""
    code = (
        "import sys; from rayvllm.data import EngineProcessorConfig, build_processor; "
        "import rayvllm.data.feeder, rayvllm.data.replica; "
        "EngineProcessorConfig(model_source='m', engine_kwargs={'tensor_parallel_size': 2})"
        ".engine_args().create_parallel_config(); "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_config_maps_to_engine_args() -> None:
    """Ray Data LLM's knobs become the engine's: the model, the pooling
    runner for `embed`, the workers' placement; contradictions fail early."""
    config = EngineProcessorConfig(
        model_source="m", task_type="embed", engine_kwargs={"tensor_parallel_size": 2},
        placement_group_config={"bundles": [{"CPU": 2}] * 2, "strategy": "SPREAD"},
    )
    args = config.engine_args()
    got = (args.model, args.task, args.num_cpus_per_worker, args.placement_group_strategy)
    assert got == ("m", "embed", 2.0, "SPREAD")
    bad = [
        dict(concurrency=(3, 2)),
        dict(model_source="a", engine_kwargs={"model": "b"}),
        dict(placement_group_config={"bundles": [{"CPU": 1}, {"CPU": 2}]}),
        dict(placement_group_config={"bundle_per_worker": {"CPU": 1}, "spread": True}),
    ]
    for fields in bad:
        with pytest.raises(ValueError):
            EngineProcessorConfig(**fields).engine_args()
    with pytest.raises(ValueError, match="3 bundles for 2 ranks"):
        EngineProcessorConfig(engine_kwargs={"tensor_parallel_size": 2},
                              placement_group_config={"bundles": [{"CPU": 1}] * 3}).engine_args()


def test_a_replicas_engine_metrics_reach_rays_prometheus_endpoint(ray_local: None, tiny_model_dir: Path) -> None:
    """The node's metrics agent (Ray's Prometheus endpoint) serves the
    replica's engine counters under Ray-legal names, tagged with the
    replica's actor name: the generated-token count is the rows' own."""
    config = _config(tiny_model_dir)
    placement = ReplicaPlacement(config)
    replica = start_replica(config, placement)
    try:
        rows = [(i, request_fields(row)) for i, row in enumerate(_rows()[:3])]
        results = [ray.get(ref) for ref in replica.process.remote(rows)]
        generated = float(sum(len(columns["generated_tokens"]) for _, columns in results))
        assert ray.get(replica.export_metrics.remote()) > 0
        name = ray_state.actor(replica._actor_id.hex()).name
        [node] = [n for n in ray.nodes() if n["Alive"]]
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        series = re.compile(r"^ray_rayvllm_generation_tokens_total\{(?P<tags>[^}]*)\} (?P<value>\S+)$", re.M)
        deadline = time.monotonic() + 60
        while True:
            text = requests.get(url, timeout=10).text
            values = [float(m["value"]) for m in series.finditer(text) if f'ReplicaId="{name}"' in m["tags"]]
            if values == [generated]:
                break
            # Ray's agents report on their own period; nothing to wait on but the endpoint itself.
            assert time.monotonic() < deadline, f"{values} != [{generated}] at {url}"
            time.sleep(0.5)
    finally:
        ray.kill(replica)
        placement.release()
