#!/usr/bin/env bash
# Runs every test this machine can run: the Rust unit tests (with the object storage source,
# feature `store`), then the Python suite against a fresh build of the extension, with the
# S3-compatible server of the object storage tests (scripts/s3-server.sh builds it once, outside
# the clone, as the venv is made once). The vLLM tests need a vLLM environment of their own
# (~6 GB): without vLLM in the venv they are skipped, and the end of the run says how to run them.
# Usage: bash scripts/test.sh [pytest args...]
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
cargo test --quiet --features store
build_ext release
FASTLOAD_S3_SERVER="${FASTLOAD_S3_SERVER:-$(bash scripts/s3-server.sh)}"
export FASTLOAD_S3_SERVER
status=0
python -m pytest "$@" || status=$?
if ! python -c "import vllm" 2>/dev/null; then
    echo
    echo "fastload: vLLM is not in this venv, so its tests (tests/integrations/test_vllm*.py) were skipped;"
    echo "they run in a vLLM environment of their own (made once, ~6 GB, outside the clone) with:"
    echo "    bash scripts/vllm-tests.sh"
fi
exit "$status"
