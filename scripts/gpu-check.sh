#!/usr/bin/env bash
# On the GPU machine: install the peer wheels of scripts/cuda-wheels.sh (if carried in .whl/),
# then run every CUDA test and the load benchmark in one go (benches/cuda_check.py).
# Needs the extension built beforehand (python/fastload/_core.abi3.so, e.g. `maturin develop
# --release` or the `build --release` of a checkout) and python3 with torch + transformers.
# Usage: bash scripts/gpu-check.sh [cuda_check.py options]   (results: $OUT or ./cuda_results.json)
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/fastload-peers .whl/*.whl
    export PYTHONPATH="/tmp/fastload-peers${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/python:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
python3 -c "import fastload._core" || {
    echo "fastload's extension is not built: python/fastload/_core.abi3.so is missing" >&2
    exit 1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 benches/cuda_check.py "$@"
