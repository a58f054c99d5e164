"""Time to put a trainer's weights into a running engine (issue 29), by each
way the engine offers, against a plain in-memory copy of the same bytes.

    python bench/weight_sync.py [--preset llama125m] [--engine local|ray]
        [--backends ray,gloo] [--repeats 3] [--json-out FILE]

The trainer is this process, holding the model's Hugging Face state dict
(float32). Rows, each the median of `--repeats` runs after an untimed one:
- floor: `copy_` of every tensor into a preallocated twin (the bytes moved
  once, in memory: nothing can be faster);
- load only: `sync_weights` of the dict into an in-process engine, which
  moves nothing (the worker takes the dict as it is) and only loads it into
  the live model (every sync pays this: a copy into each parameter, and into
  each layout a CPU float32 layer's GEMM plan keeps);
- disk: save the dict as safetensors and have every worker load its model
  from that file (`collective_rpc`), what a sync through disk costs;
- ray: the dict given to `sync_weights(dict, backend="ray")` (the client
  puts it once, as `HostWeights`); `ray.put(HostWeights.of(dict))` by the
  trainer, then `sync_weights(ref)`; and a plain `ray.put(dict)` of the
  torch tensors, then `sync_weights(ref)` (Ray pickles each tensor);
- gloo: `sync_weights(dict, backend="gloo")` (a broadcast from this process);
- transport alone, what each backend costs before any engine touches the
  bytes (`--engine ray` only): a broadcast of the dict over a gloo group to
  another process, received into buffers it allocated once; and
  `ray.put(HostWeights.of(dict))` fetched by another process and copied
  once into such buffers (the copy every load makes anyway).

`--engine ray` runs the worker in its own process on Ray (the scheduler
actor hosts it at world size 1), where the object store and the broadcast
really cross processes; `local` keeps it in this one. After the last sync
the engine's greedy tokens must equal those before (the same weights went
in): "parity" says whether they did.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_model, cpu_line, ensure_repo_on_path, format_table  # noqa: E402


def _timed(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """The median of `repeats` timed runs after `warmup` untimed ones: an RL
    loop syncs after every step, and the first syncs pay once for what later
    ones reuse (the worker's first touch of its buffers; the object store's
    first pages, for as many puts as it takes before the store reuses the
    memory of freed ones: `RAY_WARMUP`)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# Puts of the whole state dict before the object store hands out memory it
# has handed out before (a freed object's memory is reused once Ray has
# dropped its last reference, which lags a sync by a put or two).
RAY_WARMUP = 3


def _reload_from(path: str) -> Callable[[Any], None]:
    def reload(worker: Any) -> None:
        from rayvllm.models.loader import iterate_weights

        worker.runner.reload_weights(iterate_weights(Path(path), worker.runner.dtype))

    return reload


def _transport_rows(weights: dict[str, Any], repeats: int) -> dict[str, float]:
    """The two backends' transports alone, from this process to another."""
    import ray
    import torch

    from rayvllm import HostWeights
    from rayvllm.distributed.weight_transfer import TransferGroup
    from rayvllm.utils.network import free_port

    shapes = {name: (tuple(t.shape), t.dtype) for name, t in weights.items()}

    @ray.remote(num_cpus=0)
    class Receiver:
        """A process of its own with a buffer per tensor, allocated once."""

        def __init__(self) -> None:
            self.buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes.values()]

        def join(self, port: int) -> None:
            self.group = TransferGroup("gloo", "127.0.0.1", port, 1, 2)

        def receive(self) -> None:
            self.group.receive_into(self.buffers)

        def take(self, refs: list[Any]) -> None:
            for buffer, tensor in zip(self.buffers, ray.get(refs[0]).tensors().values()):
                buffer.copy_(tensor)

    receiver = Receiver.remote()
    port = free_port()
    joined = receiver.join.remote(port)
    group = TransferGroup("gloo", "127.0.0.1", port, 0, 2)  # returns once the receiver joined
    ray.get(joined)

    def gloo() -> None:
        received = receiver.receive.remote()
        group.send(weights)
        ray.get(received)

    rows = {"gloo transport alone": _timed(gloo, repeats)}
    rows["ray transport alone (put + get + one copy)"] = _timed(
        lambda: ray.get(receiver.take.remote([ray.put(HostWeights.of(weights))])), repeats, RAY_WARMUP
    )
    ray.kill(receiver)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama125m")
    parser.add_argument("--model", default=None, help="model directory (default: the preset's, built once)")
    parser.add_argument("--engine", default="local", choices=["local", "ray"])
    parser.add_argument("--backends", default="ray,gloo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    ensure_repo_on_path()
    import ray
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rayvllm import LLM, HostWeights, SamplingParams

    # A cluster of this run's own (not one `address="auto"` would find), up
    # before any timing.
    ray.init(address="local", num_cpus=4, log_to_driver=False)
    model_dir = args.model or str(build_model(None, args.preset))
    weights = {k: v.contiguous() for k, v in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict().items()}
    nbytes = sum(t.nbytes for t in weights.values())
    engine = dict(max_num_seqs=8, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    if args.engine == "ray":
        engine["distributed_executor_backend"] = "ray"
    llm = LLM(model=model_dir, **engine)
    prompt = [[11, 12, 13, 14, 15, 16]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids

    twins = {k: torch.empty_like(v) for k, v in weights.items()}
    rows: dict[str, float] = {"floor (in-memory copy)": _timed(
        lambda: [twins[k].copy_(v) for k, v in weights.items()], args.repeats
    )}
    if args.engine == "local":
        rows["load only (dict in process)"] = _timed(lambda: llm.sync_weights(weights, backend="ray"), args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.safetensors")

        def through_disk() -> None:
            save_file(weights, path)
            llm.collective_rpc(_reload_from(tmp))

        rows["disk (save + reload)"] = _timed(through_disk, args.repeats)
    for backend in args.backends.split(","):
        if backend == "ray":
            if args.engine == "ray":  # in process, this is the load only
                rows["ray (dict; the client puts)"] = _timed(
                    lambda: llm.sync_weights(weights, backend="ray"), args.repeats, RAY_WARMUP
                )
            rows["ray (put HostWeights + sync)"] = _timed(
                lambda: llm.sync_weights(ray.put(HostWeights.of(weights)), backend="ray"), args.repeats, RAY_WARMUP
            )
            rows["ray (put state dict + sync)"] = _timed(
                lambda: llm.sync_weights(ray.put(weights), backend="ray"), args.repeats, RAY_WARMUP
            )
        else:
            rows[backend] = _timed(lambda: llm.sync_weights(weights, backend=backend), args.repeats)
    if args.engine == "ray":
        rows.update(_transport_rows(weights, args.repeats))
    after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    if ray.is_initialized():
        ray.shutdown()

    floor = rows["floor (in-memory copy)"]
    print(f"# {args.preset}: {nbytes / 1e6:.0f} MB of weights; engine {args.engine}; {cpu_line()}")
    print(format_table(
        ["way", "seconds", "GB/s", "x floor"],
        [[name, f"{t:.3f}", f"{nbytes / t / 1e9:.2f}", f"{t / floor:.1f}"] for name, t in rows.items()],
    ))
    print(f"parity: {list(before) == list(after)}")
    if args.json_out:
        payload = dict(preset=args.preset, engine=args.engine, bytes=nbytes, cpu=cpu_line(), seconds=rows,
                       parity=list(before) == list(after))
        Path(args.json_out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
