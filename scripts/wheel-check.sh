#!/usr/bin/env bash
# Builds the release wheel and checks that it is publishable and installs cleanly:
#   1. `maturin build --release --zig --compatibility manylinux2014` -> dist/: one abi3 wheel for
#      CPython >= 3.10. zig (the `ziglang` package) links against glibc 2.17 whatever the host's
#      glibc is, which is what makes the wheel manylinux2014 without a manylinux container.
#   2. `auditwheel show` on it: the manylinux policy its symbols satisfy
#   3. a fresh venv with nothing but the wheel (--no-deps): `import fastload` and its Rust extension
#   4. a fresh venv that sees the build venv's packages through a .pth file (torch is a
#      multi-GB download), the wheel installed with --no-index: pip must find every runtime
#      dependency already there; then a save_file/load_file round trip run outside the clone,
#      which must not import safetensors, numpy-only code paths or transformers.
# Usage: bash scripts/wheel-check.sh [OUT_DIR]   (default: dist/)
set -euo pipefail
source "$(dirname "$0")/_env.sh"
out="${1:-$ROOT/dist}"
mkdir -p "$out"
python -c "import auditwheel" 2>/dev/null || pip install -q "auditwheel>=6"
python -c "import ziglang" 2>/dev/null || pip install -q ziglang
zig_dir="$(python -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')"
rm -f "$out"/fastload-*.whl
(cd "$ROOT" && PATH="$zig_dir:$PATH" maturin build --release --zig --compatibility manylinux2014 -o "$out")
wheel="$(ls "$out"/fastload-*.whl)"
echo "== $(basename "$wheel")"
auditwheel show "$wheel"

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
