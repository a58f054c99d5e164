"""Batch inference over Ray Data: a JSONL file of prompts in, Parquet out.

    python examples/batch.py [--model DIR] [--out DIR] [--replicas 1]

Writes a small JSONL dataset itself (text prompts, a chat and token ids,
each row with its own sampling parameters), runs it through
`rayvllm.data.build_processor` on a local Ray cluster (or the one
RAY_ADDRESS names) and writes the output rows to Parquet. Without
`--model` it uses the embedded demo model, whose text is gibberish by
design. docs/BATCH.md explains each part.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import ray

from rayvllm.data import EngineProcessorConfig, build_processor

PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is", "Ray Data is"]


def write_dataset(path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {"id": i, "prompt": p, "sampling_params": {"temperature": 0.0, "max_tokens": 16}} for i, p in enumerate(PROMPTS)
    ]
    rows.append({"id": len(rows), "messages": [{"role": "user", "content": "Tell me a joke."}],
                 "sampling_params": {"temperature": 0.8, "seed": 1, "max_tokens": 24}})
    rows.append({"id": len(rows), "prompt_token_ids": [1, 42, 43, 44], "sampling_params": {"max_tokens": 8}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the demo model)")
    parser.add_argument("--out", default=None, help="the Parquet output folder (default: a temporary one)")
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rayvllm-batch-"))
    source = work / "prompts.jsonl"
    write_dataset(source)
    out = Path(args.out) if args.out else work / "out"

    ray.init()
    config = EngineProcessorConfig(
        model_source=args.model,
        engine_kwargs={"max_model_len": 512},
        concurrency=args.replicas,
        batch_size=4,
        should_continue_on_error=True,
    )
    processor = build_processor(
        config,
        # Every row gets a tag column; the engine ignores it and keeps it.
        preprocess=lambda row: {**row, "source": source.name},
        postprocess=lambda row: {**row, "answer": row["generated_text"].strip()},
    )
    processor(ray.data.read_json(str(source))).write_parquet(str(out))
    for row in ray.data.read_parquet(str(out)).sort("id").take_all():
        print(row["id"], row["num_input_tokens"], row["num_generated_tokens"], repr(row["answer"][:60]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
