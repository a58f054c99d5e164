#!/usr/bin/env bash
# Fetch, where pip reaches PyPI, the wheels the GPU machine's image lacks
# (pydantic 2, which EngineArgs needs, and its own needs) into .whl/, which
# bench/gpu_proof.sh installs from when pydantic is missing there. The device
# call then carries the folder: run(carry=[".whl"], command="bash bench/gpu_proof.sh").
#
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]   # default 3.12, the image's python3
#
# The versions are the ones the project's CI runs with.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYVER=${1:-3.12}
rm -rf "$REPO/.whl"
mkdir -p "$REPO/.whl"
${PIP:-python3 -m pip} download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$REPO/.whl" \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.15.0
ls -l "$REPO/.whl"
