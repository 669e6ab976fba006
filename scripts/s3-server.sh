#!/usr/bin/env bash
# Installs the S3-compatible server the object storage tests and benchmark run against: s3s-fs
# (the file-system backend of the s3s crate, from crates.io), once, at a fixed path outside the
# clone (like the venv of scripts/_env.sh): ~/.cache/fastload/s3s-fs/bin/s3s-fs. Prints its path.
# Why this server, not moto's: tests/support/s3_server.py. Building it takes a few minutes, once.
# Usage: bash scripts/s3-server.sh   (FASTLOAD_S3_ROOT overrides the install root)
#
# One change to the released source: its accept loop sets TCP_NODELAY on each connection. Without
# it, the end of a response waits on the client's delayed ACK (Nagle): 7-31 of 40 sequential GETs
# of 8 B - 256 KiB stalled for more than 35 ms here, which made small reads (headers, opens) of
# the benchmarks swing by the server, not by the client. Real object stores answer without it.
set -euo pipefail
ROOT="${FASTLOAD_S3_ROOT:-$HOME/.cache/fastload/s3s-fs}"
BIN="$ROOT/bin/s3s-fs"
# 0.14.0: later releases need Rust 1.96 (this project's machines have 1.95); --locked: the
# dependency versions it was released with
VERSION="0.14.0"
SHA256="73f95b71b72392a68b522c4e41313f747322e6bbcae27a33f84770ecd1ca19b3"
STAMP="$ROOT/nodelay-$VERSION"  # the patched build is installed (an older install lacks it)
if ! { "$BIN" --version 2>/dev/null | grep -q "$VERSION" && [ -e "$STAMP" ]; }; then
    echo "fastload: installing s3s-fs $VERSION (with TCP_NODELAY) into $ROOT (once)" >&2
    command -v cargo >/dev/null || { echo "fastload: cargo (Rust) is required" >&2; exit 1; }
    src="$(mktemp -d)"
    trap 'rm -rf "$src"' EXIT
    curl -sSfL -o "$src/s3s-fs.crate" "https://static.crates.io/crates/s3s-fs/s3s-fs-$VERSION.crate"
    echo "$SHA256  $src/s3s-fs.crate" | sha256sum -c --quiet - >&2
    tar -xzf "$src/s3s-fs.crate" -C "$src"
    python3 - "$src/s3s-fs-$VERSION/src/main.rs" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
accept = "        let conn = http_server.serve_connection(TokioIo::new(socket), service.clone());"
if text.count(accept) != 1:
    sys.exit(f"fastload: {path}: the accept loop is not where 0.14.0 has it; not patched")
open(path, "w").write(text.replace(accept, "        let _ = socket.set_nodelay(true);\n" + accept))
PY
    cargo install --quiet --locked --features binary --force --path "$src/s3s-fs-$VERSION" \
        --root "$ROOT" >&2
    touch "$STAMP"
fi
echo "$BIN"
