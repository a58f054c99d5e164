"""The Ray engine (CPU, gloo) computes exactly what the single-process engine
and transformers compute, under tensor, pipeline and data parallelism, for a
mixed batch that forces chunked prefill and preemption; and it leaves nothing
behind when it shuts down."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import ray_state  # noqa: E402
from process_state import thread_niceness  # noqa: E402

from rayvllm import LLM, SamplingParams  # noqa: E402
from rayvllm.messages.outputs import RequestOutputKind  # noqa: E402
from rayvllm.utils.random_model import RandomModelSpec, build_random_model  # noqa: E402

from hf_oracle import NUM_NEW, hf_greedy  # noqa: E402

SPECS = {
    "llama-gqa": RandomModelSpec(
        arch="llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, seed=21
    ),
    "qwen3-gqa-tied": RandomModelSpec(
        arch="qwen3", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        tie_word_embeddings=True, seed=22,
    ),
    # One KV head for two TP ranks: each rank holds a replica.
    "llama-mqa": RandomModelSpec(arch="llama", num_attention_heads=4, num_key_value_heads=1, seed=23),
    # Sliding-window attention on every layer, 8 keys: every prompt runs past it.
    "mistral-window": RandomModelSpec(arch="mistral", seed=24, extra={"sliding_window": 8}),
    "phi3": RandomModelSpec(arch="phi3", seed=26),
    # Gemma 2: local layers between global ones, soft caps that bite; Gemma 3: q/k norms, two RoPE bases.
    "gemma2": RandomModelSpec(
        arch="gemma2", seed=27, num_hidden_layers=3, norm_weight_std=0.2, extra={"sliding_window": 8, "query_pre_attn_scalar": 24,
                                                           "attn_logit_softcapping": 1.0}),
    "gemma3": RandomModelSpec(
        arch="gemma3", seed=28, num_hidden_layers=3, rope_theta=1e6, norm_weight_std=0.2,
        extra={"sliding_window": 8, "query_pre_attn_scalar": 24, "rope_local_base_freq": 10000.0,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # OLMo 2's q/k norms span all heads: each TP rank all-reduces its heads' sum of squares and scales by its
    # slice of the norm weight (away from 1, so a wrong slice changes the tokens).
    "olmo2-gqa": RandomModelSpec(
        arch="olmo2", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, norm_weight_std=0.3,
        seed=27,
    ),
    # One KV head for two TP ranks: its sum of squares must count once, not once per replica.
    "olmo2-mqa": RandomModelSpec(
        arch="olmo2", num_attention_heads=4, num_key_value_heads=1, norm_weight_std=0.3, seed=28
    ),
    "granite": RandomModelSpec(
        arch="granite", seed=25, extra={"embedding_multiplier": 6.0, "attention_multiplier": 0.0625,
                                        "residual_multiplier": 0.4, "logits_scaling": 4.0},
    ),
}

# 17 blocks of 16 tokens (the floor for max_model_len=256) per DP rank; 8 sequences of up
# to ~115 tokens need far more, so the scheduler must preempt; a 32-token
# budget chunks every long prompt.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=32, num_gpu_blocks_override=17)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist-models")
    return {name: build_random_model(root / name, spec) for name, spec in SPECS.items()}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(5, 4000) for _ in range(rng.randint(3, 90))] for _ in range(8)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


_SINGLE: dict[str, list[list[int]]] = {}


def _single_process(model_dir: Path) -> list[list[int]]:
    if str(model_dir) not in _SINGLE:
        llm = LLM(str(model_dir), **ENGINE)
        _SINGLE[str(model_dir)] = _greedy(llm, _prompts())
        llm.shutdown()
    return _SINGLE[str(model_dir)]


@pytest.mark.parametrize(
    "name,sizes",
    [
        # Async scheduling: the scheduler sends TP rank 1 no sampled tokens; rank 0 hands them over.
        ("llama-gqa", dict(tensor_parallel_size=2, async_scheduling=True)),
        ("llama-gqa", dict(pipeline_parallel_size=2)),
        ("llama-gqa", dict(data_parallel_size=2)),
        ("qwen3-gqa-tied", dict(tensor_parallel_size=2)),
        ("qwen3-gqa-tied", dict(pipeline_parallel_size=2)),
        ("qwen3-gqa-tied", dict(data_parallel_size=2)),
        # TP=2 x PP=2 on qwen3-gqa-tied: test_shutdown_leaves_nothing_behind.
        ("llama-mqa", dict(tensor_parallel_size=2)),
        ("mistral-window", dict(tensor_parallel_size=2)),
        ("granite", dict(tensor_parallel_size=2)),
        # Each rank slices its heads out of the checkpoint's fused q/k/v.
        ("phi3", dict(tensor_parallel_size=2)),
        ("gemma2", dict(tensor_parallel_size=2)),
        ("gemma3", dict(tensor_parallel_size=2)),
        ("olmo2-gqa", dict(tensor_parallel_size=2)),
        # Stages pass OLMo 2's (x, residual) pair as Llama's.
        ("olmo2-gqa", dict(pipeline_parallel_size=2)),
        ("olmo2-mqa", dict(tensor_parallel_size=2)),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(
        "async" if k == "async_scheduling" else f"{k.split('_')[0]}{n}" for k, n in v.items()
    ),
)
def test_parallel_greedy_parity(ray_local: None, models: dict[str, Path], name: str, sizes: dict) -> None:
    model_dir = models[name]
    prompts = _prompts()
    llm = LLM(str(model_dir), **ENGINE, **sizes)
    try:
        if sizes.get("async_scheduling"):
            assert llm.llm_engine.config.scheduler_config.async_scheduling
        got = _greedy(llm, prompts)
        stats = llm.llm_engine.engine_core.make_stats()
    finally:
        llm.shutdown()
    # A window on every layer holds a window's blocks per sequence (the rest
    # go back to the pool): this pool, too small for the others, may suffice.
    assert stats.num_preemptions > 0 or name == "mistral-window"
    assert got == _single_process(model_dir)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(model_dir, prompt)[0]


@pytest.mark.parametrize("async_scheduling", [True, None], ids=["async", "default"])
def test_ray_client_steps_lose_nothing(
    ray_local: None, models: dict[str, Path], async_scheduling: bool | None
) -> None:
    """The SchedulerActor's loop steps on its own and pushes outputs (with
    async scheduling and room in the batch it schedules each step just in
    time, as the previous one ends); adds and aborts travel on the same
    connection. Stats read between steps and an abort mid-run must not drop
    or duplicate a token, and the aborted request's blocks must come back.
    `distributed_executor_backend="ray"` puts even a single rank on the Ray
    path: one SchedulerActor that runs the model on its loop's thread, by
    default without async scheduling (nothing to schedule ahead of), and
    nothing of it left after shutdown."""
    model_dir = models["llama-gqa"]
    prompts = _prompts()
    llm, ours, pgs = _start_engine(
        model_dir, dict(distributed_executor_backend="ray", async_scheduling=async_scheduling)
    )
    try:
        assert sorted(ours.values()) == ["SchedulerActor"]
        assert len(pgs) == 1 and next(iter(pgs.values())).startswith("rayvllm-engine-")
        _assert_torch_where_the_model_runs(ours, scheduler_runs_model=True)
        engine = llm.llm_engine
        assert engine.config.scheduler_config.async_scheduling == bool(async_scheduling)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params, output_kind=RequestOutputKind.DELTA)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        finished: set[str] = set()
        steps = 0
        aborted: str | None = None
        while engine.has_unfinished_requests():
            assert steps < 500, "a lost output left a request unfinished"
            for out in engine.step():
                tokens[out.request_id] += out.outputs[0].token_ids
                if out.finished:
                    finished.add(out.request_id)
            steps += 1
            # Mid-run: the first request seen to have streamed with more to
            # come (the loop steps on its own: while this process waits for
            # a core, a request can run to its end between two looks).
            streaming = [rid for rid, got in tokens.items() if got and rid not in finished]
            if aborted is None and streaming:
                aborted = streaming[0]
                engine.abort_request([aborted])
                assert engine.engine_core.has_pending_intake()  # sent, not yet reported applied
            assert engine.engine_core.make_stats().num_running_reqs >= 0
        assert aborted is not None
        assert not engine.engine_core.has_pending_intake()
        stats = engine.engine_core.make_stats()
        assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
        expected = _single_process(model_dir)
        for i in range(len(prompts)):
            got = tokens[str(i)]
            if str(i) == aborted:
                assert 0 < len(got) < NUM_NEW and got == expected[i][: len(got)]
            else:
                assert got == expected[i]
    finally:
        llm.shutdown()
    _assert_gone(ours, pgs)


def _alive_rayvllm_actors() -> dict[str, str]:
    """Actor id -> class name, of engine actors not dead."""
    return {a.actor_id: a.class_name for a in ray_state.actors()
            if a.class_name in ("SchedulerActor", "WorkerActor") and a.state != "DEAD"}


def _start_engine(model_dir: Path, parallel: dict[str, object]) -> tuple[LLM, dict[str, str], dict[str, str]]:
    """An engine on the shared cluster, with the engine actors and the
    placement group it added (what other tests left dying is not its)."""
    actors_before, groups_before = _alive_rayvllm_actors(), ray_state.live_placement_groups()
    llm = LLM(str(model_dir), **parallel, **ENGINE)
    ours = {k: v for k, v in _alive_rayvllm_actors().items() if k not in actors_before}
    pgs = {k: v for k, v in ray_state.live_placement_groups().items() if k not in groups_before}
    return llm, ours, pgs


def _assert_torch_where_the_model_runs(ours: dict[str, str], scheduler_runs_model: bool) -> None:
    """torch (its import's CPU and memory) only in processes that run the
    model: every rank, and the SchedulerActor only where it hosts one."""
    pids = {a.actor_id: a.pid for a in ray_state.actors() if a.actor_id in ours}
    for actor_id, name in ours.items():
        loads_torch = "libtorch" in Path(f"/proc/{pids[actor_id]}/maps").read_text()
        assert loads_torch == (name == "WorkerActor" or scheduler_runs_model), name


def _assert_every_thread_at_niceness_0(ours: dict[str, str]) -> None:
    """The engine's actors run the latency path: Ray starts a worker at 15,
    the actor lowers itself (actors/niceness.py), torch's threads included."""
    pids = {a.actor_id: a.pid for a in ray_state.actors() if a.actor_id in ours}
    for actor_id, name in ours.items():
        nice = thread_niceness(pids[actor_id])
        assert nice == {0}, (name, nice)


def _assert_gone(ours: dict[str, str], pgs: dict[str, str]) -> None:
    """The actors (and with their processes, the gloo process groups) are
    gone; a killed actor's state turns DEAD asynchronously, so poll."""
    for _ in range(300):
        if not ours.keys() & _alive_rayvllm_actors().keys():
            break
        ray.get(ray.remote(lambda: None).remote())  # one scheduling round trip
    assert not ours.keys() & _alive_rayvllm_actors().keys()
    assert not pgs.keys() & ray_state.live_placement_groups().keys()


def test_shutdown_leaves_nothing_behind(ray_local: None, models: dict[str, Path]) -> None:
    """TP=2 x PP=2: the engine's actors and placement group, and none after
    shutdown. The engine also answers greedy parity with the single-process
    engine and transformers (the parity test leaves this shape here rather
    than start it twice; the single rank on Ray is
    test_ray_client_steps_lose_nothing's; test_placement runs llama-gqa
    at this shape across nodes)."""
    from rayvllm.actors.ray_core_client import RayEngineCoreClient

    model_dir = models["qwen3-gqa-tied"]
    prompts = _prompts()
    llm, ours, pgs = _start_engine(model_dir, dict(tensor_parallel_size=2, pipeline_parallel_size=2))
    try:
        assert sorted(ours.values()) == ["SchedulerActor"] + ["WorkerActor"] * 4
        assert len(pgs) == 1 and next(iter(pgs.values())).startswith("rayvllm-dp0-")
        _assert_torch_where_the_model_runs(ours, scheduler_runs_model=False)
        assert isinstance(llm.llm_engine.engine_core, RayEngineCoreClient)
        got = _greedy(llm, prompts)
        assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0
        _assert_every_thread_at_niceness_0(ours)
    finally:
        llm.shutdown()
    assert got == _single_process(model_dir)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(model_dir, prompt)[0]
    _assert_gone(ours, pgs)
