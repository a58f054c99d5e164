"""How many data-parallel ranks one scheduler can drive (issue 15).

    python bench/scheduler_scale.py [--ranks 1,2,4,8,16,32,64] [--seqs-per-rank 256]
        [--steps 30] [--prompt-len 32] [--json-out FILE]

The engine core (`EngineCore`: per rank a `Scheduler` with its KV block pool
and prefix cache, the prefix index and router in front) runs in this process
against a null executor per rank that returns a sampled token for every
scheduled request at once: no model, no Ray, no channel. Each rank gets
`--seqs-per-rank` requests of `--prompt-len` random ids (all prefilled in the
first step), greedy with `ignore_eos`, so every timed step is a pure decode
step of `ranks x seqs-per-rank` sequences. Timed: the core's `step()` (all
ranks scheduled, submitted, and their outputs applied), median over
`--steps` steps after one warmup step.

Printed per rank count: the core's step time, per rank, decisions per second
(sequences scheduled per second), and whether one scheduler thread keeps
that many ranks fed at a 20 ms and a 50 ms model step (its step fits in the
model's, so the workers never wait); then the largest measured rank count
that fits each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_line, ensure_repo_on_path, format_table, median  # noqa: E402

ensure_repo_on_path()

from rayvllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig  # noqa: E402
from rayvllm.engine.engine_core import EngineCore  # noqa: E402
from rayvllm.executor.base import Executor  # noqa: E402
from rayvllm.messages.engine_types import ModelRunnerOutput  # noqa: E402
from rayvllm.messages.request import EngineCoreRequest  # noqa: E402
from rayvllm.messages.sampling_params import SamplingParams  # noqa: E402
from rayvllm.messages.scheduler_output import SchedulerOutput  # noqa: E402

MODEL_STEPS_MS = (20.0, 50.0)


class NullExecutor(Executor):
    """Every scheduled request samples token 7 (prompts fit one step)."""

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        super().__init__(config)
        self.num_blocks = num_blocks

    def initialize(self) -> int:
        return self.num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [7] * len(ids), None, {})


def measure(ranks: int, args: argparse.Namespace) -> dict[str, float]:
    seqs = args.seqs_per_rank
    max_len = args.prompt_len + args.steps + 8
    block = 16
    blocks_per_seq = -(-max_len // block)
    config = EngineConfig(
        model_config=ModelConfig(
            model="null", tokenizer="null", dtype="float32", max_model_len=max_len, seed=0, hf_config={}
        ),
        cache_config=CacheConfig(block_size=block, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=seqs, max_num_batched_tokens=max(seqs * args.prompt_len, 2048), max_model_len=max_len,
        ),
        parallel_config=ParallelConfig(data_parallel_size=ranks),
    )
    num_blocks = seqs * blocks_per_seq + 2
    core = EngineCore(config, lambda rank: NullExecutor(config, num_blocks))
    rng = random.Random(ranks)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.steps + 4)
    for i in range(ranks * seqs):
        prompt = [rng.randrange(10, 30000) for _ in range(args.prompt_len)]
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=params,
                                           eos_token_id=None))
    core.step()  # prefill every prompt
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outputs = core.step()
        times.append(time.perf_counter() - t0)
        assert len(outputs) == ranks * seqs, f"{len(outputs)} outputs, expected {ranks * seqs}"
    core.shutdown()
    step_s = median(times)
    per_rank_s = step_s / ranks
    return {
        "ranks": ranks,
        "seqs": ranks * seqs,
        "step_ms": step_s * 1e3,
        "per_rank_ms": per_rank_s * 1e3,
        "decisions_per_s": ranks * seqs / step_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4,8,16,32,64")
    p.add_argument("--seqs-per-rank", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    results = [measure(int(r), args) for r in args.ranks.split(",")]
    rows = [
        [str(r["ranks"]), str(r["seqs"]), f"{r['step_ms']:.2f}", f"{r['per_rank_ms']:.3f}",
         f"{r['decisions_per_s']:,.0f}", *("yes" if r["step_ms"] <= ms else "no" for ms in MODEL_STEPS_MS)]
        for r in results
    ]
    print(f"{cpu_line()}; one thread, null executor, {args.seqs_per_rank} decoding sequences per rank, "
          f"median of {args.steps} steps")
    print(format_table(["DP ranks", "sequences", "core step ms", "per rank ms", "decisions/s",
                        *(f"fits {int(ms)} ms" for ms in MODEL_STEPS_MS)], rows))
    for ms in MODEL_STEPS_MS:
        fed = [r["ranks"] for r in results if r["step_ms"] <= ms]
        print(f"at a {ms:.0f} ms model step one scheduler thread feeds up to {max(fed) if fed else 0} "
              f"of the measured rank counts")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
