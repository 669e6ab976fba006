#!/usr/bin/env bash
# The aarch64 wheel, installed into an aarch64 CPython run under qemu-user on this x86_64 host, with
# an aarch64 torch and safetensors from PyPI: tests/support/platform_smoke.py (load_file, save_file,
# safe_open with slices and conversions, from_pretrained of a small nn.Module), each result
# bitwise equal to safetensors'. Heavy and slow (emulated), so not part of .ci/run: run it when the
# packaging or the engine's arithmetic changes.
#
# What it uses, all from package registries (nothing else is reachable here):
#   - qemu-aarch64-static: Debian's qemu-user-static (installed with apt-get when missing; root)
#   - CPython 3.11 for arm64: Debian's python3.11-minimal and libpython3.11-stdlib with the libraries
#     they link (arm64 packages, `apt-get download` after `dpkg --add-architecture arm64`), unpacked
#     with `dpkg -x` into a sysroot that qemu's -L points at
#   - torch, safetensors and torch's pure-Python dependencies: PyPI's aarch64 wheels, installed by
#     this host's pip with --platform/--target (nothing is compiled). torch is pinned to
#     $FASTLOAD_AARCH64_TORCH (default 2.9.1): 2.9.1's aarch64 wheel is a CPU build (its CUDA
#     requirements are marked x86_64); 2.15's is a CUDA build that does not import without the CUDA
#     wheels it requires (cuDNN, NCCL, the CUDA toolkit: gigabytes).
# The sysroot and the dependencies are cached at $FASTLOAD_AARCH64_ROOT
# (default ~/.cache/fastload/aarch64); the fastload wheel is installed afresh on every run.
# Runtime here (2 cores): about 1 minute with the cache, plus the cross build of the wheel
# (scripts/wheels.sh, ~9 minutes) when none is given, plus ~1 minute of downloads the first time.
# Usage: bash scripts/aarch64-smoke.sh [WHEEL]   (default: builds dist/'s aarch64 wheel)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${FASTLOAD_AARCH64_ROOT:-$HOME/.cache/fastload/aarch64}"
torch_req="torch==${FASTLOAD_AARCH64_TORCH:-2.9.1}"
wheel="${1:-}"
if [ -z "$wheel" ]; then
    bash "$ROOT/scripts/wheels.sh" "$ROOT/dist" aarch64
    wheel="$(ls "$ROOT"/dist/fastload_safetensors-*-manylinux*_aarch64.whl)"
fi
wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"

if ! command -v qemu-aarch64-static >/dev/null; then
    apt-get update -q >/dev/null
    apt-get install -y -q qemu-user-static >/dev/null
fi

sysroot="$cache/sysroot"
python_arm="$sysroot/usr/bin/python3.11"
if [ ! -x "$python_arm" ]; then
    echo "aarch64-smoke: unpacking Debian's arm64 CPython into $sysroot (once)" >&2
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        dpkg --add-architecture arm64
    fi
    apt-get update -q >/dev/null
    debs="$(mktemp -d)"
    # python3.11 and everything it (and torch's libraries) links, as Debian's Depends list them
    packages=(python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1
        libstdc++6 libgomp1 libexpat1 zlib1g libbz2-1.0 libcrypt1 libffi8 liblzma5 libncursesw6
        libtinfo6 libreadline8 libsqlite3-0 libssl3 libuuid1 libnsl2 libtirpc3 libdb5.3
        libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1 libzstd1)
    (cd "$debs" && apt-get download -q "${packages[@]/%/:arm64}" >/dev/null)
    rm -rf "$sysroot.partial" && mkdir -p "$sysroot.partial"
    for deb in "$debs"/*.deb; do dpkg -x "$deb" "$sysroot.partial"; done
    rm -rf "$debs" "$sysroot" && mv "$sysroot.partial" "$sysroot"
fi
run_arm() { qemu-aarch64-static -L "$sysroot" "$python_arm" "$@"; }
arm_version="$(run_arm -c 'import sys; print("%d%d" % sys.version_info[:2])')"

# pip's options for the aarch64 interpreter: its version, and the platform tags its glibc accepts
glibc_minor="$(run_arm -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split(".")[1])')"
target=(--only-binary=:all: --implementation cp --python-version "$arm_version"
    --abi "cp$arm_version" --abi abi3 --abi none)
for minor in $(seq 17 "$glibc_minor"); do target+=(--platform "manylinux_2_${minor}_aarch64"); done
target+=(--platform manylinux2014_aarch64 --platform any)

# --no-deps and the list by hand: pip evaluates dependency markers against this x86_64 host, which
# would ask for x86_64-only CUDA wheels. torch's own Requires-Dist less those, safetensors and numpy
# (the reference's writer needs it for some dtypes), tqdm (fastload's).
requirements=("$torch_req" filelock "typing-extensions>=4.10" "sympy>=1.13.3" mpmath
    "networkx>=2.5.1" jinja2 markupsafe "fsspec>=0.8.5" "safetensors>=0.8" "numpy>=1.24"
    "tqdm>=4.60")
deps="$cache/site-$(echo "${requirements[*]}" | sha256sum | cut -c1-12)"
if [ ! -d "$deps" ]; then
    echo "aarch64-smoke: installing ${requirements[*]} for aarch64 into $deps (once)" >&2
    rm -rf "$deps.partial"
    python3 -m pip install -q --no-deps --target "$deps.partial" "${target[@]}" "${requirements[@]}"
    mv "$deps.partial" "$deps"
fi

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# the wheel's tags are checked here: pip refuses it unless it fits the aarch64 interpreter
python3 -m pip install -q --no-deps --target "$scratch/site" "${target[@]}" "$wheel"
echo "== $(basename "$wheel") under qemu-aarch64 ($(qemu-aarch64-static --version | head -1))"
start=$SECONDS
# sys.path[0] is tests/support/ (the script's folder): tensor_samples comes from the clone, fastload from
# the wheel; the working directory is a scratch folder, away from the clone's python/
(cd "$scratch" && PYTHONPATH="$scratch/site:$deps" run_arm "$ROOT/tests/support/platform_smoke.py")
echo "== aarch64 smoke test: ok in $((SECONDS - start)) s"
