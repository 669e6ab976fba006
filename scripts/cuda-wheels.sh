#!/usr/bin/env bash
# Downloads the GPU peers of benches/cuda_check.py as wheels into .whl/ (ignored by git), for a
# GPU machine that has PyTorch, transformers and safetensors but no package registry.
# Target: CPython 3.12 on x86-64 Linux. Usage: bash scripts/cuda-wheels.sh [python-version]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-3.12}"
PEERS=(fastsafetensors==0.5.0 runai-model-streamer==0.17.1 instanttensor==0.2.2)
mkdir -p .whl
platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
    manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${platforms[@]}" -d .whl "${PEERS[@]}"
ls -la .whl
