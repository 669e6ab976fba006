#!/usr/bin/env bash
# Side-by-side load benchmark against the peers; writes bench-results/results.{json,png}.
# Usage: bash scripts/bench.sh [--size-gib 4] [--repeats 5] [--dtypes bfloat16] ...
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
build_ext release
python -m fastload.bench "$@"
