#!/usr/bin/env bash
# Runs every test: the Rust unit tests, then the Python suite against a fresh build of the extension.
# Usage: bash scripts/test.sh [pytest args...]
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
cargo test --quiet
build_ext release
python -m pytest "$@"
