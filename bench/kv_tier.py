"""The second KV tier on multi-turn chats over more documents than one
rank's KV pool holds: prefix hit rate and TTFT with the tier off, in host
memory ("native") and in the Ray object store ("ray").

    python bench/kv_tier.py [--topology both|dp2|replicas] [--tiers off,native,ray]
        [--load online|rounds] [--arrival-rate 2] [--think-s 1]
        [--preset llama25m] [--docs 16] [--doc-len 512] [--turns 3] [--pool-frac 0.25]
        [--json-out FILE]

Workload: `--docs` documents of `--doc-len` random tokens; each is one chat
of `--turns` turns. Turn t's prompt is the document, every earlier question
and answer, and a new `--question-len`-token question; its answer is
`--answer-len` greedy tokens. Each rank's pool holds `--pool-frac` of the
documents' blocks (and at least one longest chat); keep it above
`--max-num-seqs` longest chats, or preemption swamps the comparison.

Loads:
- online (default): a server's load. Chats start at Poisson times
  (`--arrival-rate` chats a second, seeded); each turn is sent when the one
  before has answered plus a think time (exponential, mean `--think-s`),
  and streamed (`AsyncLLM`, as the server runs it); TTFT is the client's
  wait from sending a turn to its first token. Other chats' documents
  push a chat's blocks out of the pool while its user thinks.
- rounds: an offline queue. Turn 1 of every chat, then turn 2, ..., all
  chats of a round in one `LLM.generate` batch, so a document's blocks have
  left the pool by its next turn whenever the documents outgrow it; TTFT
  (the engine's first_token_time - arrival_time) includes the wait behind
  the rest of the batch.

Topologies (all on Ray):
- dp2: one engine with data_parallel_size=2 (requests routed by prefix);
- replicas: two independent engines (each its own SchedulerActor, as two
  Serve replicas), turn t of chat d sent to engine (d + t) % 2, so every
  later turn lands on the engine that did not compute the one before: only
  a tier both can read ("ray") can serve its prefix.

Per configuration: prefix hit rate (prefix-cache hit tokens / prompt
tokens, which counts what the tier brought back), the tier's own share,
and TTFT (median, p90 and mean over the turns after the first, where a hit
is possible). Every configuration's tokens must equal the tier-off run's
(greedy): "parity" says whether they did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_model, cpu_line, ensure_repo_on_path, format_table, median, percentile  # noqa: E402

BLOCK = 16


def _chats(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    rng = random.Random(f"kv-tier-{args.seed}")
    ids = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]  # noqa: E731
    docs = [ids(args.doc_len) for _ in range(args.docs)]
    questions = [[ids(args.question_len) for _ in range(args.turns)] for _ in range(args.docs)]
    return docs, questions


def _engine_kwargs(args: argparse.Namespace, model: str, tier: str, dp: int) -> dict[str, Any]:
    max_len = args.doc_len + args.turns * (args.question_len + args.answer_len) + BLOCK
    per_seq = -(-max_len // BLOCK) + 1
    pool = max(per_seq + 1, int(args.pool_frac * args.docs * args.doc_len / BLOCK))
    kwargs: dict[str, Any] = dict(
        model=model, dtype="float32", max_model_len=max_len, num_gpu_blocks_override=pool,
        max_num_seqs=args.max_num_seqs, data_parallel_size=dp, distributed_executor_backend="ray",
    )
    if tier != "off":
        kwargs.update(kv_offloading_backend=tier, kv_offloading_size=args.tier_gib)
    return kwargs


def _kill_directory(kwargs: dict[str, Any]) -> None:
    import ray

    from rayvllm.config.engine_args import EngineArgs
    from rayvllm.kv_offload.ray_tier import KV_TIER_NAMESPACE, directory_name

    oc = EngineArgs(**kwargs).create_engine_config().kv_offload_config
    if oc is None or oc.backend != "ray":
        return
    try:
        ray.kill(ray.get_actor(directory_name(oc.fingerprint), namespace=KV_TIER_NAMESPACE))
    except ValueError:
        pass


def _hit_rates(cores: list[Any]) -> tuple[float, float]:
    """(prefix hits, of which the tier's) / prompt tokens, over the engines' cores."""
    queries = hits = tier_hits = 0
    for core in cores:
        stats = core.make_stats()
        queries += stats.prefix_cache_stats.queries
        hits += stats.prefix_cache_stats.hits
        if stats.kv_offload_stats is not None:
            tier_hits += stats.kv_offload_stats.hits
    return hits / max(queries, 1), tier_hits / max(queries, 1)


def run_config(args: argparse.Namespace, model: str, topology: str, tier: str, vocab: int) -> dict[str, Any]:
    kwargs = _engine_kwargs(args, model, tier, dp=2 if topology == "dp2" else 1)
    try:
        if args.load == "online":
            answers, ttfts, (hit_rate, tier_hit_rate) = asyncio.run(_run_online(args, kwargs, topology, vocab))
        else:
            answers, ttfts, (hit_rate, tier_hit_rate) = _run_rounds(args, kwargs, topology, vocab)
    finally:
        _kill_directory(kwargs)
    return {
        "topology": topology, "tier": tier, "load": args.load, "hit_rate": hit_rate, "tier_hit_rate": tier_hit_rate,
        "ttft_median_s": median(ttfts), "ttft_p90_s": percentile(ttfts, 90),
        "ttft_mean_s": sum(ttfts) / len(ttfts), "answers": answers, "pool_blocks": kwargs["num_gpu_blocks_override"],
    }


async def _run_online(
    args: argparse.Namespace, kwargs: dict[str, Any], topology: str, vocab: int
) -> tuple[list[list[list[int]]], list[float], tuple[float, float]]:
    from rayvllm import SamplingParams
    from rayvllm.actors.factory import async_llm_from_engine_args
    from rayvllm.config.engine_args import EngineArgs

    docs, questions = _chats(args, vocab)
    engines = [async_llm_from_engine_args(EngineArgs(**kwargs)) for _ in range(1 if topology == "dp2" else 2)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    rng = random.Random(f"kv-tier-load-{args.seed}")
    starts, at = [], 0.0
    for _ in docs:
        at += rng.expovariate(args.arrival_rate)
        starts.append(at)
    thinks = [[rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0.0 for _ in range(args.turns)]
              for _ in docs]
    answers: list[list[list[int]]] = [[] for _ in docs]
    ttfts: list[float] = []

    async def chat(d: int, t0: float) -> None:
        await asyncio.sleep(max(0.0, t0 + starts[d] - time.monotonic()))
        history = list(docs[d])
        for turn in range(args.turns):
            if turn > 0:
                await asyncio.sleep(thinks[d][turn])
            prompt = history + questions[d][turn]
            engine = engines[(d + turn) % len(engines)]
            sent, first, answer = time.monotonic(), None, []
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"chat{d}-turn{turn}"):
                first = time.monotonic() if first is None else first
                answer += out.outputs[0].token_ids
            if turn > 0 and first is not None:
                ttfts.append(first - sent)
            answers[d].append(answer)
            history = prompt + answer

    try:
        for engine in engines:  # both warm before the clock starts
            async for _ in engine.generate({"prompt_token_ids": [11, 12, 13]}, params, "warmup"):
                pass
        t0 = time.monotonic()
        await asyncio.gather(*(chat(d, t0) for d in range(len(docs))))
        return answers, ttfts, _served_hit_rates(engines)
    finally:
        for engine in engines:
            engine.shutdown()


def _served_hit_rates(engines: list[Any]) -> tuple[float, float]:
    """`_hit_rates` for serving engines, whose loop takes the cores'
    counters into its Prometheus counters as it goes: what is left is
    taken in, then the counters are read."""
    totals = {"rayvllm:prefix_cache_queries": 0.0, "rayvllm:prefix_cache_hits": 0.0, "rayvllm:kv_offload_hits": 0.0}
    for engine in engines:
        engine.metrics.record_scheduler_stats(engine.engine_core.make_stats())
        for family in engine.metrics.families():
            if family.name in totals:
                totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    queries = max(totals["rayvllm:prefix_cache_queries"], 1.0)
    return totals["rayvllm:prefix_cache_hits"] / queries, totals["rayvllm:kv_offload_hits"] / queries


def _run_rounds(
    args: argparse.Namespace, kwargs: dict[str, Any], topology: str, vocab: int
) -> tuple[list[list[list[int]]], list[float], tuple[float, float]]:
    from rayvllm import LLM, SamplingParams

    docs, questions = _chats(args, vocab)
    engines = [LLM(**kwargs)] if topology == "dp2" else [LLM(**kwargs), LLM(**kwargs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    history = [list(doc) for doc in docs]
    answers: list[list[list[int]]] = [[] for _ in docs]
    ttfts: list[float] = []
    try:
        for engine in engines:
            engine.llm_engine.engine_core.make_stats()
        for turn in range(args.turns):
            prompts = [history[d] + questions[d][turn] for d in range(len(docs))]
            by_engine: dict[int, list[int]] = {}
            for d in range(len(docs)):
                by_engine.setdefault((d + turn) % len(engines), []).append(d)
            for e, chat_ids in sorted(by_engine.items()):
                outs = engines[e].generate(
                    [{"prompt_token_ids": prompts[d]} for d in chat_ids], params, use_tqdm=False
                )
                for d, out in zip(chat_ids, outs):
                    answer = list(out.outputs[0].token_ids)
                    answers[d].append(answer)
                    history[d] = prompts[d] + answer
                    m = out.metrics
                    if turn > 0 and m is not None and m.first_token_time is not None:
                        ttfts.append(m.first_token_time - m.arrival_time)
        return answers, ttfts, _hit_rates([e.llm_engine.engine_core for e in engines])
    finally:
        for engine in engines:
            engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=["both", "dp2", "replicas"], default="both")
    p.add_argument("--tiers", default="off,native,ray")
    p.add_argument("--load", choices=["online", "rounds"], default="online",
                   help="online: chats arrive and think as a server's users do; rounds: one batch per turn")
    p.add_argument("--arrival-rate", type=float, default=2.0, help="online: chats started per second (Poisson)")
    p.add_argument("--think-s", type=float, default=1.0, help="online: mean pause between a turn's answer and the next")
    p.add_argument("--preset", default="llama25m")
    p.add_argument("--model", default=None)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--answer-len", type=int, default=16)
    p.add_argument("--pool-frac", type=float, default=0.25)
    p.add_argument("--tier-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=2, help="per rank; the pool must hold this many chats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    ensure_repo_on_path()
    import ray

    model = str(args.model or build_model(None, args.preset))
    with open(Path(model) / "config.json") as f:
        vocab = int(json.load(f)["vocab_size"])
    machine = cpu_line()
    print(f"model {model}\nmachine: {machine}", flush=True)
    # A cluster of its own unless one is named (RAY_ADDRESS, e.g. to span nodes).
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), log_to_driver=False)
    tiers = args.tiers.split(",")
    topologies = ["dp2", "replicas"] if args.topology == "both" else [args.topology]
    results = []
    try:
        for topology in topologies:
            reference = None
            for tier in tiers:
                print(f"{topology}, tier {tier} ...", flush=True)
                r = run_config(args, model, topology, tier, vocab)
                reference = reference if reference is not None else r["answers"]
                r["parity"] = r["answers"] == reference
                results.append(r)
    finally:
        ray.shutdown()
    rows = [
        [r["topology"], r["tier"], f"{100 * r['hit_rate']:.1f}%", f"{100 * r['tier_hit_rate']:.1f}%",
         f"{1000 * r['ttft_median_s']:.1f} ms", f"{1000 * r['ttft_p90_s']:.1f} ms", f"{1000 * r['ttft_mean_s']:.1f} ms",
         "ok" if r["parity"] else "DIFFERS"]
        for r in results
    ]
    print()
    print(format_table(["topology", "tier", "prefix hits", "from tier", "TTFT median", "TTFT p90", "TTFT mean",
                        "parity"], rows))
    load = (f"online: {args.arrival_rate:g} chats/s, think {args.think_s:g} s" if args.load == "online"
            else "rounds: one batch per turn")
    print(f"({args.docs} chats x {args.turns} turns over {args.doc_len}-token documents, {load}; pool "
          f"{results[0]['pool_blocks']} blocks of {BLOCK} per rank; TTFT over turns 2..{args.turns}; {machine})")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine, "model": model, "args": vars(args),
                       "results": [{k: v for k, v in r.items() if k != "answers"} for r in results]}, f, indent=2)
        print(f"wrote {args.json_out}")
    if not all(r["parity"] for r in results):
        raise SystemExit("tokens differ from the tier-off run")


if __name__ == "__main__":
    main()
