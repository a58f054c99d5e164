"""Build a benchmark model directory (seeded, random weights, local tokenizer).

    python bench/make_model.py --out DIR [--preset llama25m|tiny]

Presets (see bench/_common.py):
  llama25m  Llama, hidden 288, 6 layers, 6 heads x 48 (6 KV heads),
            intermediate 768, vocab 32000, float32, 2048 positions, seed 0.
  tiny      Llama, hidden 128, 2 layers, 4 heads x 32 (4 KV heads),
            intermediate 256, vocab 4096: for per-step overhead benchmarks.

Without --out the model goes to ~/.cache/rayvllm/bench-<preset>. An existing
complete directory is reused. Prints the directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PRESETS, build_model  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="model directory (default ~/.cache/rayvllm/bench-<preset>)")
    parser.add_argument("--preset", default="llama25m", choices=sorted(PRESETS))
    args = parser.parse_args(argv)
    print(build_model(args.out, args.preset))


if __name__ == "__main__":
    main()
