#!/usr/bin/env bash
# Builds the release artifacts and checks that they are publishable and install cleanly:
#   1. scripts/wheels.sh: the manylinux2014 abi3 wheels for x86_64 and aarch64 (maturin + zig,
#      each found consistent with its manylinux tag by `auditwheel show`) and the sdist
#   2. a fresh venv with nothing but the x86_64 wheel (--no-deps): `import fastload` and its Rust
#      extension
#   3. a fresh venv that sees the project venv's packages through a .pth file (torch is a
#      multi-GB download), the wheel installed with --no-index: pip must find every runtime
#      dependency already there; then a save/load round trip run outside the clone, which must
#      not import safetensors or transformers
#   4. the sdist built from scratch in a clean venv (`pip wheel`: maturin from PyPI, the crates
#      from crates.io, a fresh target folder), the wheel it makes installed and imported
# The aarch64 wheel runs under qemu in scripts/aarch64-smoke.sh.
# Usage: bash scripts/wheel-check.sh [OUT_DIR]   (default: dist/)
set -euo pipefail
source "$(dirname "$0")/_env.sh"
out="${1:-$ROOT/dist}"
bash "$ROOT/scripts/wheels.sh" "$out" x86_64 aarch64 sdist
wheel="$(ls "$out"/fastload_safetensors-*-manylinux*_x86_64.whl)"
sdist="$(ls "$out"/fastload_safetensors-*.tar.gz)"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
base_python="$(python -c 'import sys; print(sys._base_executable)')"

echo "== a bare venv: the wheel alone"
"$base_python" -m venv "$scratch/bare"
"$scratch/bare/bin/pip" install -q --no-deps --no-index "$wheel"
(cd "$scratch" && "$scratch/bare/bin/python" -c "import fastload, fastload._core; print('import fastload', fastload.__version__, 'ok')")

echo "== a fresh venv with the runtime dependencies already present"
# --without-pip: the venv's own bundled pip/setuptools would shadow the build venv's (torch
# requires a recent setuptools); pip itself then comes through the .pth file too.
"$base_python" -m venv --without-pip "$scratch/full"
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
full_site="$("$scratch/full/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$site" >"$full_site/build-venv.pth"
"$scratch/full/bin/python" -m pip install -q --no-index "$wheel"
(cd "$scratch" && "$scratch/full/bin/python" - <<'PY'
import sys

import torch

import fastload

assert fastload.__file__.startswith(sys.prefix), fastload.__file__  # the wheel, not the clone
t = {"w": torch.randn(3, 4), "b": torch.arange(4, dtype=torch.int32)}
fastload.save_file(t, "check.safetensors")
back = fastload.load_file("check.safetensors")
assert all(torch.equal(back[k], v) for k, v in t.items())
for module in ("safetensors", "transformers"):
    assert module not in sys.modules, f"{module} was imported by a plain save/load"
print("round trip ok:", fastload.__file__)
PY
)

echo "== the sdist, built from scratch in a clean venv"
"$base_python" -m venv "$scratch/sdist"
# unset: the build must not reuse this clone's target folder
(cd "$scratch" && env -u CARGO_TARGET_DIR "$scratch/sdist/bin/pip" wheel -q --no-deps \
    -w "$scratch/from-sdist" "$sdist")
built="$(ls "$scratch"/from-sdist/fastload_safetensors-*.whl)"
echo "built $(basename "$built")"
"$scratch/sdist/bin/pip" install -q --no-deps --no-index "$built"
(cd "$scratch" && "$scratch/sdist/bin/python" -c "import fastload, fastload._core; print('import fastload from the sdist ok')")
