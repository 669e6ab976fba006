#!/usr/bin/env bash
# Side-by-side load benchmark against the peers; writes bench-results/llama-<size>GiB.{json,md,png}.
# Usage: bash scripts/bench.sh [--sizes 1,4] [--modes warm,cold] [--repeats 3] [--dtypes bfloat16] ...
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
build_ext release
python -m fastload.tools.bench "$@"
