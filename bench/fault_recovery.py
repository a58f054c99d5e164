"""What a fault costs (issue 16): kill a process of a running engine and
measure how long the streams stall and whether any request is lost.

    python bench/fault_recovery.py [--scenarios world1-scheduler,tp2-rank1,tp2-scheduler,dp2-rank1,poison]
        [--streams 4] [--max-tokens 200] [--kill-after 20] [--preset tiny | --model DIR]
        [--json-out FILE]

Each scenario starts a local Ray cluster and an `AsyncLLM` on Ray (the
serving engine, as the LLMServer replica holds it), opens `--streams`
greedy streams of `--max-tokens` tokens (ignore_eos), and once stream 0
has `--kill-after` tokens injects the fault:
  world1-scheduler  SIGKILL of the SchedulerActor at world size 1 (it runs the model)
  tp2-rank1         SIGKILL of TP rank 1's WorkerActor (rank 0 then waits in an all-reduce)
  tp2-scheduler     SIGKILL of the SchedulerActor at TP=2 (its workers die with it)
  dp2-rank1         SIGKILL of DP rank 1's WorkerActor at DP=2 (rank 1 alone is
                    rebuilt; rank 0 serves on)
  poison            a request whose step raises on the worker (the seed hook of
                    tests/fault_hooks.py, installed in every Ray worker)
Reported per scenario: requests in flight at the fault, requests lost
(a stream that did not finish, or whose tokens differ from an undisturbed
in-process run: a repeated or missing token shows as a difference), the
engine's own restart time (`RestartPolicy.last_duration_s`: failure seen to
new engine ready), and the stall (the longest wait between two tokens, of
any stream, after the fault: detection + restart + recompute of the context)
and the least-stalled stream's longest wait (with DP, a stream on a rank
that did not fail).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PRESETS, build_model, cpu_line, ensure_repo_on_path, format_table  # noqa: E402

ensure_repo_on_path()

SCENARIOS = ("world1-scheduler", "tp2-rank1", "tp2-scheduler", "dp2-rank1", "poison")
VICTIMS = {"tp2-rank1": "WorkerActor(rank=1)", "dp2-rank1": "WorkerActor(rank=0, dp_rank=1)"}
TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


def _victim_pid(scenario: str) -> int:
    import ray
    from ray.util.state import list_actors

    # This script's own cluster, even with another on the machine.
    address = ray.get_runtime_context().gcs_address
    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True)
    want = VICTIMS.get(scenario, "SchedulerActor")
    return next(a.pid for a in alive if want in (a.repr_name, a.class_name))


async def _run(scenario: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from rayvllm import SamplingParams
    from rayvllm.actors.factory import async_llm_from_engine_args
    from rayvllm.config.engine_args import EngineArgs
    from rayvllm.engine.async_llm import AsyncLLM
    from rayvllm.messages.errors import RequestFailedError

    parallel: dict[str, Any] = {"distributed_executor_backend": "ray"}
    if scenario.startswith("tp2"):
        parallel = {"tensor_parallel_size": 2}
    elif scenario.startswith("dp2"):
        parallel = {"data_parallel_size": 2}
    engine = async_llm_from_engine_args(EngineArgs(model=model, max_model_len=1024, **parallel))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i] * (i + 1) for i in range(args.streams)]
    tokens: list[list[int]] = [[] for _ in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]
    fault: dict[str, Any] = {}

    async def poison() -> str:
        from fault_hooks import POISON_SEED

        seeded = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8)
        try:
            async for _ in engine.generate({"prompt_token_ids": [11, 12, 13]}, seeded, "poisoned"):
                pass
        except RequestFailedError:
            return "failed alone"
        return "not failed"

    async def consume(i: int) -> None:
        async for out in engine.generate({"prompt_token_ids": prompts[i]}, params, f"s{i}"):
            tokens[i] += out.outputs[0].token_ids
            arrivals[i].append(time.monotonic())
            if i == 0 and len(tokens[0]) >= args.kill_after and not fault:
                fault["in_flight"] = sum(1 for t in tokens if len(t) < args.max_tokens)
                fault["at"] = time.monotonic()
                if scenario == "poison":
                    fault["poison"] = asyncio.ensure_future(poison())
                else:
                    os.kill(_victim_pid(scenario), signal.SIGKILL)

    try:
        await asyncio.gather(*(consume(i) for i in range(len(prompts))))
        poisoned = await fault["poison"] if "poison" in fault else None
    finally:
        engine.shutdown()
    stalls = []
    for times in arrivals:
        after = [fault["at"]] + [t for t in times if t > fault["at"]]
        stalls.append(max((b - a for a, b in zip(after, after[1:])), default=None))
    known = [s for s in stalls if s is not None]
    return {
        "tokens": tokens,
        "in_flight": fault["in_flight"],
        "restarts": engine.restarts.total,
        "restart_s": engine.restarts.last_duration_s,
        "stall_s": max(known, default=None),
        "least_stall_s": min(known, default=None),
        "poisoned_request": poisoned,
    }


def _undisturbed(model: str, args: argparse.Namespace) -> list[list[int]]:
    from rayvllm import LLM, SamplingParams

    llm = LLM(model=model, max_model_len=1024)
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i] * (i + 1) for i in range(args.streams)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--kill-after", type=int, default=20)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--model", default=None)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    import ray

    model = str(args.model or build_model(None, args.preset))
    expected = _undisturbed(model, args)
    rows = []
    for scenario in args.scenarios.split(","):
        if scenario not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
        path = os.pathsep.join(x for x in (str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if x)
        sys.path.insert(0, str(TESTS_DIR))
        ray.init(num_cpus=4, log_to_driver=False, runtime_env={
            "worker_process_setup_hook": "fault_hooks.poison_seed", "env_vars": {"PYTHONPATH": path}})
        try:
            result = asyncio.run(_run(scenario, model, args))
        finally:
            ray.shutdown()
        lost = sum(1 for got, want in zip(result.pop("tokens"), expected) if got != want)
        rows.append({"scenario": scenario, "lost": lost, **result})
    print(f"{cpu_line()}; model {model}; {args.streams} streams x {args.max_tokens} tokens, fault after "
          f"{args.kill_after}")
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    print(format_table(
        ["scenario", "in flight", "lost", "restarts", "restart s", "stall s", "least stall s", "poisoned request"],
        [[r["scenario"], str(r["in_flight"]), str(r["lost"]), str(r["restarts"]), seconds(r["restart_s"]), seconds(r["stall_s"]),
          seconds(r["least_stall_s"]), r["poisoned_request"] or "-"] for r in rows],
    ))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
