#!/usr/bin/env bash
# Runs every test: the Rust unit tests (with the object storage source, feature `store`), then the
# Python suite against a fresh build of the extension. The object storage tests need the s3s-fs
# server (bash scripts/s3-server.sh installs it); without it they are skipped.
# Usage: bash scripts/test.sh [pytest args...]
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
cargo test --quiet --features store
build_ext release
python -m pytest "$@"
