"""The second KV tier on multi-turn chats over more documents than one
rank's KV pool holds: prefix hit rate and TTFT with the tier off, in host
memory ("native") and in the Ray object store ("ray").

    python bench/kv_tier.py [--topology both|dp2|replicas] [--tiers off,native,ray]
        [--preset llama25m] [--docs 16] [--doc-len 512] [--turns 3] [--pool-frac 0.25]
        [--json-out FILE]

Workload: `--docs` documents of `--doc-len` random tokens; each is one chat
of `--turns` turns. Turn t's prompt is the document, every earlier question
and answer, and a new `--question-len`-token question; its answer is
`--answer-len` greedy tokens. Turns go round by round (turn 1 of every
chat, then turn 2, ...), all chats of a round in one batch, so a
document's blocks have left the pool by its next turn whenever the
documents outgrow it: each rank's pool holds `--pool-frac` of the
documents' blocks (and at least one longest chat); keep it above
`--max-num-seqs` longest chats, or preemption swamps the comparison.

Topologies (all on Ray):
- dp2: one engine with data_parallel_size=2 (requests routed by prefix);
- replicas: two independent engines (each its own SchedulerActor, as two
  Serve replicas), turn t of chat d sent to engine (d + t) % 2, so every
  later turn lands on the engine that did not compute the one before: only
  a tier both can read ("ray") can serve its prefix.

Per configuration: prefix hit rate (prefix-cache hit tokens / prompt
tokens, which counts what the tier brought back), the tier's own share,
and TTFT (first_token_time - arrival_time, median and mean over the turns
after the first, where a hit is possible). Every configuration's tokens
must equal the tier-off run's (greedy): "parity" says whether they did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_model, cpu_line, ensure_repo_on_path, format_table, median  # noqa: E402

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


def run_config(args: argparse.Namespace, model: str, topology: str, tier: str, vocab: int) -> dict[str, Any]:
    from rayvllm import LLM, SamplingParams

    docs, questions = _chats(args, vocab)
    kwargs = _engine_kwargs(args, model, tier, dp=2 if topology == "dp2" else 1)
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
        queries = hits = tier_hits = 0
        for engine in engines:
            stats = engine.llm_engine.engine_core.make_stats()
            queries += stats.prefix_cache_stats.queries
            hits += stats.prefix_cache_stats.hits
            if stats.kv_offload_stats is not None:
                tier_hits += stats.kv_offload_stats.hits
    finally:
        for engine in engines:
            engine.shutdown()
        _kill_directory(kwargs)
    return {
        "topology": topology, "tier": tier, "hit_rate": hits / max(queries, 1),
        "tier_hit_rate": tier_hits / max(queries, 1), "ttft_median_s": median(ttfts),
        "ttft_mean_s": sum(ttfts) / len(ttfts), "answers": answers,
        "pool_blocks": kwargs["num_gpu_blocks_override"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=["both", "dp2", "replicas"], default="both")
    p.add_argument("--tiers", default="off,native,ray")
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
         f"{1000 * r['ttft_median_s']:.1f} ms", f"{1000 * r['ttft_mean_s']:.1f} ms", "ok" if r["parity"] else "DIFFERS"]
        for r in results
    ]
    print()
    print(format_table(["topology", "tier", "prefix hits", "from tier", "TTFT median", "TTFT mean", "parity"], rows))
    print(f"({args.docs} chats x {args.turns} turns over {args.doc_len}-token documents; pool "
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
