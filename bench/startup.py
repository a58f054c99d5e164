"""Engine start time: how long until an engine can take requests (issue 26).

    python bench/startup.py [--engines inproc,ray] [--preset llama25m]
        [--repeats 3] [--tensor-parallel-size 1] [--json-out FILE]

Each start runs in a fresh Python process, as a user's script or a Serve
replica does, and reports two times: `import`, from the child's first line
to `rayvllm` imported, and `LLM()`, the engine's construction: the
tokenizer, the core and its workers, the model's weights and the KV cache
(on Ray the SchedulerActor and worker processes too; the local cluster is
started before the timer). The median of --repeats, with the range.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_model, cpu_line, format_table, median  # noqa: E402

CHILD = """
import json, sys, time
started = time.perf_counter()
from rayvllm import LLM
imported = time.perf_counter()
engine, model, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {"tensor_parallel_size": tp}
if engine == "ray":
    import ray
    ray.init(address="local", num_cpus=max(2, tp + 1), include_dashboard=False, log_to_driver=False)
    options["distributed_executor_backend"] = "ray"
before = time.perf_counter()
llm = LLM(model, **options)
ready = time.perf_counter()
llm.shutdown()
print("RESULT " + json.dumps({"import_s": imported - started, "start_s": ready - before}))
"""


def one_start(engine: str, model: Path, tp: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, engine, str(model), str(tp)], capture_output=True,
                         text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} start failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def spread(values: list[float]) -> str:
    return f"{median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="inproc,ray")
    p.add_argument("--preset", default="llama25m")
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: --preset's, built once)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()
    model = args.model or build_model(None, args.preset)  # built once, then reused
    results: dict[str, list[dict[str, float]]] = {}
    # Engines alternate within each repeat, so a drifting machine weighs on both.
    for _ in range(args.repeats):
        for engine in args.engines.split(","):
            results.setdefault(engine, []).append(one_start(engine, model, args.tensor_parallel_size))
    rows = [[engine, spread([r["import_s"] for r in runs]), spread([r["start_s"] for r in runs])]
            for engine, runs in results.items()]
    print(f"{model.name}, TP={args.tensor_parallel_size}, {args.repeats} starts each; {cpu_line()}")
    print(format_table(["engine", "import s", "LLM() s"], rows))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"cpu": cpu_line(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
