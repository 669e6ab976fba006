#!/usr/bin/env bash
# Installs the S3-compatible server the object storage tests and benchmark run against: s3s-fs
# (the file-system backend of the s3s crate, from crates.io), once, at a fixed path outside the
# clone (like the venv of scripts/_env.sh): ~/.cache/fastload/s3s-fs/bin/s3s-fs. Prints its path.
# Why this server, not moto's: tests/support/s3_server.py. Building it takes a few minutes, once.
# Usage: bash scripts/s3-server.sh   (FASTLOAD_S3_ROOT overrides the install root)
set -euo pipefail
ROOT="${FASTLOAD_S3_ROOT:-$HOME/.cache/fastload/s3s-fs}"
BIN="$ROOT/bin/s3s-fs"
# 0.14.0: later releases need Rust 1.96 (this project's machines have 1.95); --locked: the
# dependency versions it was released with
VERSION="0.14.0"
if ! "$BIN" --version 2>/dev/null | grep -q "$VERSION"; then
    echo "fastload: installing s3s-fs $VERSION into $ROOT (once)" >&2
    command -v cargo >/dev/null || { echo "fastload: cargo (Rust) is required" >&2; exit 1; }
    cargo install --quiet --locked --features binary --version "$VERSION" --root "$ROOT" s3s-fs >&2
fi
echo "$BIN"
