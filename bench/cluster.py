"""Several replicas as one service: KV-aware routing against Serve's
power-of-two-choices router on multi-turn chats (issue 27).

    python bench/cluster.py [--routers kv,pow2,pow2,kv] [--sessions 24 --turns 6]

Each router runs in its own `serve run serve_app:build_app num_replicas=2
request_router=R` (the README's command with two options: the router
ingress answers on direct ingress), one after the other, on the same model
(llama25m preset unless --model) and the same conversations:
`--sessions` chats, each opening with one of `--system-prompts` shared
system prompts, `--turns` turns each; every turn's prompt is the whole
conversation so far (system prompt, earlier user turns and replies) plus a
new user turn, sent when the chat's previous turn has finished, so the
chats arrive interleaved. Requests carry the chat's `x-session-id`.
Prompts are text (`--prompts tokens`: token ids), the replies fixed per
turn (not the model's), so every router sees the same prompts.

Reported per router: the prefix-cache hit rate (the servers' own
`usage.prompt_tokens_details.cached_tokens` over prompt tokens), TTFT p50
and p99, output throughput, and the wall time. A repeated router name runs
it again (both orders, to see what order costs). `peer` in --routers runs
Ray Serve LLM over vLLM's CPU engine with its PrefixCacheAffinityRouter,
the same number of replicas (bench/peer_serve_llm.py, from the peer
environment that bench/setup_peers.sh makes; vLLM's CPU settings as
bench/throughput.py sets them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (bench/serving.py: the server launcher)
from throughput import vllm_env  # noqa: E402

BENCH = Path(__file__).resolve().parent
PEER_PORT = 8300


Prompt = list[int] | str
Chat = list[tuple[Prompt, int]]


def conversations(
    args: argparse.Namespace, vocab: Sequence[int], decode: Callable[[list[int]], str] | None
) -> list[Chat]:
    """Per session, per turn: the prompt and its token count, fixed by
    `--seed`. With `decode`, prompts are text: each segment (system prompt,
    turn, reply) decoded on its own, so a turn's text begins with the whole
    text of the turn before. Token ids are drawn from `vocab`."""
    rng = random.Random(args.seed)

    def segment(n: int) -> Prompt:
        ids = [rng.choice(vocab) for _ in range(n)]
        return decode(ids) if decode is not None else ids

    def joined(parts: list[Prompt]) -> Prompt:
        if decode is not None:
            return "".join(str(p) for p in parts)
        return [t for p in parts for t in p]  # type: ignore[union-attr]

    systems = [segment(args.system_len) for _ in range(args.system_prompts)]
    chats = []
    for s in range(args.sessions):
        history = [systems[s % len(systems)]]
        tokens = args.system_len
        turns: Chat = []
        for _ in range(args.turns):
            history.append(segment(args.user_len))
            tokens += args.user_len
            turns.append((joined(history), tokens))
            history.append(segment(args.output_len))  # the reply the next turn carries
            tokens += args.output_len
        chats.append(turns)
    return chats


async def chat(
    http: aiohttp.ClientSession, url: str, model: str, session: int, turns: Chat,
    output_len: int, t0: float,
) -> list[dict[str, Any]]:
    out = []
    for prompt, _ in turns:
        payload = {
            "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        ttft = None
        usage: dict[str, Any] = {}
        async with http.post(url, json=payload, headers={"x-session-id": f"chat-{session}"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                usage = chunk.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        out.append({
            "session": session, "sent_s": start - t0, "ttft_s": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": details.get("cached_tokens") or 0, "output_tokens": usage["completion_tokens"],
        })
    return out


async def run_chats(base_url: str, model: str, chats: list[Chat], args: argparse.Namespace
                    ) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            chat(http, f"{base_url}/v1/completions", model, s, turns, args.output_len, t0)
            for s, turns in enumerate(chats)
        ))
        wall = time.perf_counter() - t0
    rows = [r for session in results for r in session]
    ttfts = [r["ttft_s"] * 1000 for r in rows if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in rows)
    return {
        "requests": len(rows),
        "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt,
        "ttft_p50_ms": serving.percentile(ttfts, 50),
        "ttft_p99_ms": serving.percentile(ttfts, 99),
        "output_tok_s": sum(r["output_tokens"] for r in rows) / wall,
        "wall_s": wall,
        "rows": rows,
    }


def peer_launch(model: str, args: argparse.Namespace, log_dir: Path) -> serving.ServerLaunch:
    """Ray Serve LLM over vLLM, in the peer environment."""
    argv = [args.vllm_python, str(BENCH / "peer_serve_llm.py"), "--model", model, "--port", str(PEER_PORT),
            "--replicas", str(args.replicas), "--max-num-seqs", str(args.max_num_seqs)]
    # The peer's best setting for several engines on one node, and what each
    # rayvllm replica's engine runs while all are busy (worker/core_share.py):
    # its share of the cores, unpinned (pinned, vLLM's engines would all bind
    # the same cores, and Serve gives every replica one environment).
    threads = str(max(1, (os.cpu_count() or 1) // args.replicas))
    env = {**os.environ, **vllm_env({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads})}
    return serving.ServerLaunch(name="peer", argv=argv, env=env, cwd=str(log_dir), port=PEER_PORT,
                                stop_signal=signal.SIGTERM, ray_stop=False, health_path="/-/healthz")


def run_router(router: str, model: str, chats: list[Chat], args: argparse.Namespace,
               log_dir: Path, index: int) -> dict[str, Any]:
    if router == "peer":
        launch = peer_launch(model, args, log_dir)
    else:
        launch_args = argparse.Namespace(
            max_num_seqs=args.max_num_seqs, rayvllm_ingress="direct",
            rayvllm_arg=[f"num_replicas={args.replicas}", f"request_router={router}"],
        )
        launch = serving.rayvllm_launch(model, launch_args)
    server = serving.ServerProcess(launch, log_dir / f"{index}-{router}.log")
    print(f"[{router}] starting: {' '.join(launch.argv)}", flush=True)
    try:
        server.start()
        startup_s, served = server.wait_ready(args.startup_timeout)
        print(f"[{router}] ready after {startup_s:.1f} s", flush=True)
        # One request per replica's worth of warm-up, on prompts no chat shares.
        warm: list[Chat] = [[(f"warm-up {i} " * 16, 64)] for i in range(args.replicas * 2)]
        asyncio.run(run_chats(launch.base_url, served, warm, args))
        result = asyncio.run(run_chats(launch.base_url, served, chats, args))
    finally:
        server.stop()
    result["router"] = router
    print(f"[{router}] hit rate {result['hit_rate']:.1%}, TTFT p50 {result['ttft_p50_ms']:.1f} ms "
          f"p99 {result['ttft_p99_ms']:.1f} ms, {result['output_tok_s']:.1f} tok/s, {result['wall_s']:.1f} s", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default="kv,pow2,peer,peer,pow2,kv",
                   help="request_router values to run, in order; 'peer': Ray Serve LLM over vLLM")
    p.add_argument("--vllm-python", default=str(BENCH.parent / ".venv-vllm" / "bin" / "python"),
                   help="the peer environment's python (bench/setup_peers.sh)")
    p.add_argument("--model", default=None, help="model dir (default: llama25m preset)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256, help="tokens of each system prompt")
    p.add_argument("--user-len", type=int, default=32, help="tokens of each user turn")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each reply")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--prompts", choices=("text", "tokens"), default="text",
                   help="text (Ray Serve LLM's PrefixCacheAffinityRouter matches text only) or token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    model = serving.resolve_model(args.model)
    vocab_size = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    vocab: Sequence[int] = range(5, vocab_size)
    decode = None
    if args.prompts == "text":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        decode = tokenizer.decode
        # Ids whose text tokenizes back to themselves: a text prompt then has
        # about as many tokens as the ids it was drawn as.
        vocab = [i for i in range(5, min(vocab_size, 8192))
                 if tokenizer.encode(" " + tokenizer.decode([i]).strip(), add_special_tokens=False)[-1:] == [i]]
    chats = conversations(args, vocab, decode)
    log_dir = Path(tempfile.mkdtemp(prefix="rayvllm-cluster-"))
    print(f"{args.sessions} chats x {args.turns} turns, {args.system_prompts} system prompts of {args.system_len} "
          f"tokens, {args.replicas} replicas; logs in {log_dir}", flush=True)
    results = [run_router(r.strip(), model, chats, args, log_dir, i)
               for i, r in enumerate(args.routers.split(",")) if r.strip()]
    print("\nrouter  hit rate  TTFT p50 ms  TTFT p99 ms  out tok/s  wall s")
    for r in results:
        print(f"{r['router']:<7} {r['hit_rate']:>8.1%}  {r['ttft_p50_ms']:>11.1f}  {r['ttft_p99_ms']:>11.1f}  "
              f"{r['output_tok_s']:>9.1f}  {r['wall_s']:>6.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
