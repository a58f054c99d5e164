"""KV blocks one long request holds on a sliding-window model, against the
same model without its window.

    python bench/window_blocks.py [--tokens 8192] [--window 4096]
        [--block-size 16] [--new-tokens 64] [--json-out FILE]

One request of `--tokens` tokens (a random prompt, then `--new-tokens`
greedy ones) runs alone in-process on a tiny random Mistral (2 layers,
hidden 128) whose every layer has a window of `--window` keys
(Mistral-7B-v0.1's 4,096 by default), then on the same weights with
`sliding_window` unset. After each step is scheduled the script counts the
blocks the pool has handed out (the request's, as it runs alone): the most
at once (the peak, during the chunked prefill: the window plus a chunk)
and at the request's last step. The KV cache manager releases the blocks
wholly behind the window (core/kv_cache_manager.py), so the windowed
request ends holding at most ceil((W - 1) / block_size) + 1 blocks; without
the window it holds ceil(tokens / block_size). Timing is not measured.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit_result, ensure_repo_on_path, format_table, random_ids  # noqa: E402

VOCAB_SIZE = 4096


@dataclass
class BlocksHeld:
    """Blocks owned after each scheduled step of one request."""

    per_step: list[int]

    @property
    def peak(self) -> int:
        return max(self.per_step)

    @property
    def last(self) -> int:
        return self.per_step[-1]


def window_bound(window: int, block_size: int) -> int:
    """The most blocks a decoding request holds under a window of `window`
    keys: its next query reads the W keys up to its own position, which
    span at most ceil((W - 1) / block_size) + 1 blocks."""
    return -(-(window - 1) // block_size) + 1


def build_models(root: Path, window: int, max_len: int) -> tuple[Path, Path]:
    """A random Mistral with a window on every layer and its twin without
    one (same seed, so the same weights): (windowed, full)."""
    ensure_repo_on_path()
    from rayvllm.utils.random_model import RandomModelSpec, build_random_model

    def spec(sliding_window: int | None) -> RandomModelSpec:
        return RandomModelSpec(
            arch="mistral", vocab_size=VOCAB_SIZE, max_position_embeddings=max_len, seed=21,
            extra={"sliding_window": sliding_window},
        )

    return build_random_model(root / "windowed", spec(window)), build_random_model(root / "full", spec(None))


def measure(
    model_dir: Path, num_tokens: int, new_tokens: int, block_size: int, max_num_batched_tokens: int = 2048
) -> BlocksHeld:
    """Run one request of `num_tokens` tokens (the last `new_tokens` of
    them generated) alone and count the pool's owned blocks after each
    step is scheduled."""
    ensure_repo_on_path()
    from rayvllm import LLM, SamplingParams

    prompt = random_ids(random.Random(0), num_tokens - new_tokens, VOCAB_SIZE)
    # Room for the whole request (and the null block), so both runs get the same pool.
    llm = LLM(
        model=str(model_dir), max_num_seqs=1, max_model_len=num_tokens, block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens, num_gpu_blocks_override=-(-num_tokens // block_size) + 1,
    )
    held: list[int] = []
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        schedule = scheduler.schedule

        def counted() -> Any:
            out = schedule()
            if out.total_num_scheduled_tokens:
                held.append(pool.num_blocks - 1 - pool.get_num_free_blocks())
            return out

        scheduler.schedule = counted
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == new_tokens
    finally:
        llm.shutdown()
    return BlocksHeld(held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="the request's length, prompt plus generated")
    parser.add_argument("--window", type=int, default=4096, help="the windowed model's sliding_window")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated (the rest is prompt)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        windowed_dir, full_dir = build_models(Path(root), args.window, args.tokens)
        runs = {
            f"window {args.window}": measure(windowed_dir, args.tokens, args.new_tokens, args.block_size),
            "no window": measure(full_dir, args.tokens, args.new_tokens, args.block_size),
        }
    bound = window_bound(args.window, args.block_size)
    rows = [[name, str(run.peak), str(run.last)] for name, run in runs.items()]
    print(f"one request of {args.tokens} tokens ({args.new_tokens} generated), block_size {args.block_size}")
    print(format_table(["model", "peak blocks", "blocks at its last step"], rows))
    print(f"bound with the window: ceil((W - 1) / block_size) + 1 = {bound}; "
          f"all {args.tokens} tokens: {-(-args.tokens // args.block_size)} blocks")
    emit_result(
        {"args": vars(args), "bound": bound, "runs": {name: asdict(run) for name, run in runs.items()}},
        args.json_out,
    )


if __name__ == "__main__":
    main()
