"""The seam between the model runner and the features: the runner's
package imports no feature, the features reach the runner only through
the extension protocol, and an extension registered through it sees its
hooks in order, with the step's real data, on a real tiny model."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.model_executor.extension import ModelRunnerExtension
from rayvllm.model_executor.extension_context import (
    BeginStepContext,
    LogitsContext,
    ModelLoadContext,
    PrepareInputsContext,
    SampleContext,
)
from rayvllm.model_executor.model_runner import ModelRunner
from rayvllm.models.interface import CausalLM
from rayvllm.worker import extensions

PACKAGE = Path(__file__).resolve().parent.parent / "rayvllm"
FEATURES = ("rayvllm.lora", "rayvllm.spec_decode", "rayvllm.structured_output", "rayvllm.kv_offload")


def _imports(folder: Path) -> dict[str, set[str]]:
    """Every module each file of `folder` imports: module level, under
    TYPE_CHECKING and inside functions alike."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(PACKAGE.parent))] = names
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_model_executor_imports_no_feature_and_nothing_above_it() -> None:
    above = (*FEATURES, "rayvllm.worker", "rayvllm.executor", "rayvllm.engine", "rayvllm.entrypoints", "rayvllm.actors")
    wrong = {
        path: sorted(n for n in names if _within(n, above))
        for path, names in _imports(PACKAGE / "model_executor").items()
    }
    assert {path: names for path, names in wrong.items() if names} == {}


def test_features_reach_the_runner_only_through_the_protocol() -> None:
    """No feature imports the ModelRunner, the Worker, or another feature."""
    for feature in FEATURES:
        folder = PACKAGE / feature.split(".")[1]
        others = tuple(f for f in FEATURES if f != feature)
        for path, names in _imports(folder).items():
            bad = [
                n for n in names
                if _within(n, (*others, "rayvllm.worker", "rayvllm.model_executor.model_runner"))
            ]
            assert not bad, f"{path} imports {bad}"


class _Recorder(ModelRunnerExtension):
    """Records every hook with a summary of what it was given (and the
    context itself); forces every sampled token to `forced` by masking the
    logits in `before_sample`."""

    def __init__(self, forced: int) -> None:
        self.forced = forced
        self.calls: list[tuple[str, Any, Any]] = []

    def load_model(self, ctx: ModelLoadContext) -> None:
        self.calls.append(("load_model", (ctx.model, ctx.dtype, ctx.device), ctx))

    def kv_cache_models(self) -> list[CausalLM]:
        self.calls.append(("kv_cache_models", None, None))
        return []

    def initialize_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.calls.append(("initialize_kv_cache", kv_caches, None))

    def begin_step(self, ctx: BeginStepContext) -> None:
        so = ctx.scheduler_output
        summary = ([n.req_id for n in so.scheduled_new_reqs], dict(so.num_scheduled_tokens))
        self.calls.append(("begin_step", summary, ctx))

    def prepare_inputs(self, ctx: PrepareInputsContext) -> None:
        summary = ([s.req_id for s in ctx.states], ctx.q_lens.tolist(), [s.req_id for s in ctx.sampling])
        self.calls.append(("prepare_inputs", summary, ctx))

    def before_sample(self, ctx: LogitsContext) -> None:
        self.calls.append(("before_sample", (tuple(ctx.logits.shape), len(ctx.verifying)), ctx))
        rows = ctx.sampling_logits
        keep = rows[:, self.forced].clone()
        rows.fill_(float("-inf"))
        rows[:, self.forced] = keep

    def after_sample(self, ctx: SampleContext) -> None:
        summary = ([s.req_id for s in ctx.sampling], list(ctx.sampled_token_ids), ctx.verified, ctx.spec_decode)
        self.calls.append(("after_sample", summary, ctx))

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None, None))


def test_an_extension_sees_its_hooks_in_order(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A toy extension given to the runner by the worker's composition: its
    setup hooks run once, in order; each step runs begin_step,
    prepare_inputs, before_sample and after_sample with the step's
    request, token counts, logits and sampled tokens; its logits edit
    decides the tokens; no context holds the runner."""
    recorder = _Recorder(forced=7)
    compose = extensions.create_extensions
    monkeypatch.setattr(extensions, "create_extensions", lambda config, parallel: [*compose(config, parallel), recorder])
    llm = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=64,
              kv_cache_memory_bytes=8 << 20)
    prompt = list(range(10, 30))
    try:
        runner: ModelRunner = llm.llm_engine.engine_core.engine_core.executor.runner
        assert runner.extensions[-1] is recorder
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)
        assert out[0].outputs[0].token_ids == [7, 7, 7, 7]
    finally:
        llm.shutdown()

    names = [name for name, _, _ in recorder.calls]
    setup_end = names.index("initialize_kv_cache") + 1
    assert names[0] == "load_model" and set(names[1 : setup_end - 1]) == {"kv_cache_models"}
    assert names[-1] == "shutdown"
    assert names[setup_end:-1] == ["begin_step", "prepare_inputs", "before_sample", "after_sample"] * 4

    assert recorder.calls[0][1] == (runner.model, torch.float32, runner.device)
    assert recorder.calls[setup_end - 1][1] is runner.kv_caches
    steps = [summary for _, summary, _ in recorder.calls[setup_end:-1]]
    (req_id,), scheduled = steps[0]
    assert scheduled == {req_id: len(prompt)}
    assert steps[1] == ([req_id], [len(prompt)], [req_id])
    assert steps[2] == ((1, runner.model_config.vocab_size), 0)
    assert steps[3::4] == [([req_id], [7], {}, None)] * 4
    assert steps[4::4] == [([], {req_id: 1})] * 3
    assert steps[5::4] == [([req_id], [1], [req_id])] * 3
    contexts = [ctx for _, _, ctx in recorder.calls if ctx is not None]
    assert not [ctx for ctx in contexts if any(isinstance(v, ModelRunner) for v in vars(ctx).values())]
