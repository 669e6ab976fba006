#!/usr/bin/env bash
# Builds the release artifacts and checks each Linux wheel against its manylinux policy:
#   x86_64   fastload_safetensors-<v>-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
#   aarch64  fastload_safetensors-<v>-cp310-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64.whl
#   sdist    fastload_safetensors-<v>.tar.gz (builds with a Rust toolchain and a C compiler: wheel-check.sh)
# One abi3 wheel per platform serves every CPython >= 3.10. Both wheels are built on this host with
# `maturin build --zig`: zig links against glibc 2.17 whatever the host's glibc is (that is what
# makes them manylinux2014 without a manylinux container) and is the C compiler and linker of the
# aarch64 cross build (ring's C and assembly included). `auditwheel show` must find each wheel
# consistent with the manylinux tag it carries.
# The build tools (maturin, ziglang, auditwheel) live in their own venv, created once at
# $FASTLOAD_WHEEL_TOOLS (default ~/.cache/fastload/wheel-tools), not in the project's venv.
# Usage: bash scripts/wheels.sh [OUT_DIR] [x86_64] [aarch64] [sdist]   (default: dist/, all three)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$ROOT/dist}" && cd "${1:-$ROOT/dist}" && pwd)"
shift || true
what=("$@")
[ ${#what[@]} -gt 0 ] || what=(x86_64 aarch64 sdist)

tools="${FASTLOAD_WHEEL_TOOLS:-$HOME/.cache/fastload/wheel-tools}"
if ! "$tools/bin/python" -c "import maturin, ziglang, auditwheel" 2>/dev/null; then
    echo "wheels: creating the build tools' venv at $tools (once)" >&2
    python3 -m venv "$tools"
    "$tools/bin/pip" install -q "maturin>=1.7,<2" "ziglang>=0.13" "auditwheel>=6"
fi
zig_dir="$("$tools/bin/python" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')"
export PATH="$tools/bin:$zig_dir:$PATH"
command -v cargo >/dev/null || { echo "wheels: cargo (Rust) is required: https://rustup.rs" >&2; exit 1; }

audit() { # audit WHEEL ARCH: auditwheel must agree with the manylinux tag in the file name
    local wheel="$1" arch="$2" report tag
    report="$(auditwheel show "$wheel")"
    echo "$report"
    tag="$(grep -o "manylinux_2_[0-9]*_$arch" <<<"$(basename "$wheel")" | head -1)"
    [ -n "$tag" ] || { echo "wheels: $wheel carries no manylinux tag for $arch" >&2; exit 1; }
    # auditwheel wraps its lines: compare with the whitespace folded
    grep -q "consistent with the following platform tag: \"$tag\"" <<<"$(tr -s ' \n' '  ' <<<"$report")" || {
        echo "wheels: auditwheel does not find $(basename "$wheel") consistent with $tag" >&2
        exit 1
    }
    echo "== $(basename "$wheel"): consistent with $tag"
}

for item in "${what[@]}"; do
    case "$item" in
    x86_64 | aarch64)
        triple="$item-unknown-linux-gnu"
        if command -v rustup >/dev/null && ! rustup target list --installed | grep -qx "$triple"; then
            rustup target add "$triple"
        fi
        rm -f "$out"/fastload_safetensors-*-manylinux*_"$item".whl
        (cd "$ROOT" && maturin build --release --zig --target "$triple" \
            --compatibility manylinux2014 -o "$out")
        audit "$(ls "$out"/fastload_safetensors-*-manylinux*_"$item".whl)" "$item"
        ;;
    sdist)
        rm -f "$out"/fastload_safetensors-*.tar.gz
        (cd "$ROOT" && maturin sdist -o "$out")
        sdist="$(ls "$out"/fastload_safetensors-*.tar.gz)"
        # what a build from it needs, and nothing of the clone's build outputs or tests
        listing="$(tar -tzf "$sdist")"
        for need in pyproject.toml Cargo.toml Cargo.lock rust/lib.rs python/fastload/__init__.py \
            python/fastload/py.typed README.md LICENSE; do
            grep -qx "fastload_safetensors-[^/]*/$need" <<<"$listing" || {
                echo "wheels: $need is missing from $(basename "$sdist")" >&2
                exit 1
            }
        done
        # the clone's build outputs stay out (ignored by git, so by cargo's and maturin's lists)
        if grep -E "^fastload_safetensors-[^/]*/(target|dist)/|\.(so|whl|pyc)$" <<<"$listing"; then
            echo "wheels: $(basename "$sdist") holds build outputs (above)" >&2
            exit 1
        fi
        echo "== $(basename "$sdist"): $(wc -l <<<"$listing") entries"
        ;;
    *)
        echo "wheels: unknown artifact '$item' (x86_64, aarch64, sdist)" >&2
        exit 2
        ;;
    esac
done
