#!/usr/bin/env bash
# The suite three times in a row while other processes keep every core busy: the suite must not
# depend on timing. Uses the `python` on PATH (the venv of scripts/_env.sh, activated) and this
# checkout's fastload (PYTHONPATH; its extension built by scripts/test.sh), and stops the busy
# processes however it exits.
# Usage: bash scripts/stress-test.sh [pytest args and test paths; default: tests]
#        (RUNS=3 and BUSY=<number of cores> override the counts)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
runs="${RUNS:-3}"
busy="${BUSY:-$(nproc)}"
pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop EXIT
for _ in $(seq "$busy"); do
    python -c "while True: pass" &
    pids+=("$!")
done
echo "stress-test: $busy busy processes (${pids[*]}), $runs runs" >&2
for run in $(seq "$runs"); do
    echo "stress-test: run $run of $runs" >&2
    python -m pytest -q -p no:cacheprovider "${@:-tests}"
done
echo "stress-test: $runs runs passed under load" >&2
