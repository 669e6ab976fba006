#!/usr/bin/env bash
# diffusers' own loading tests, unpatched and under fastload.patch_diffusers(): fails when a test
# that passes unpatched does not pass patched (scripts/diffusers_suite.py, scripts/patched_suite.py).
# Usage: bash scripts/diffusers-tests.sh [--families unet_2d,ddim,...]   (default: all 9)
# The tests come from ../shared/diffusers-tests (FASTLOAD_SHARED overrides ../shared): diffusers'
# tests at v0.40.0, which run against diffusers 0.40.0, and it pins huggingface-hub<2, which
# transformers 5.25 (the main venv's) refuses. So they run in a second venv beside the main one
# (${FASTLOAD_VENV}-dft) holding diffusers 0.40.0, huggingface-hub<2, the newest transformers
# accepting it (5.24), the tests' plugins and optimum-quanto (diffusers 0.40 takes the main venv's
# `optimum` for it and the tests import it), ahead of the main venv's packages, which it sees
# through a .pth (torch is not installed twice).
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
SHARED="${FASTLOAD_SHARED:-$ROOT/../shared}/diffusers-tests"
if [ ! -f "$SHARED/diffusers-tests.tgz" ]; then
    echo "diffusers-tests: skipped, $SHARED/diffusers-tests.tgz is not there" >&2
    exit 0
fi
use_checkout  # fastload from this checkout, also in the suite's venv (through PYTHONPATH)
python -c "import fastload._core" 2>/dev/null || build_ext release
DFT_VENV="$(side_venv dft)"  # the suite's pins first, then the main venv's packages
"$DFT_VENV/bin/python" - <<'PY' 2>/dev/null || "$DFT_VENV/bin/pip" install -q "diffusers==0.40.0" \
    "huggingface-hub<2" "transformers>=5,<6" "pytest==8.4.2" pytest-timeout optimum-quanto \
    Pillow parameterized requests requests_mock httpx
import diffusers, huggingface_hub, optimum.quanto, parameterized, pytest, requests_mock, transformers
assert diffusers.__version__ == "0.40.0" and pytest.__version__.startswith("8.4")
PY
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
tar xzf "$SHARED/diffusers-tests.tgz" -C "$WORK"
"$DFT_VENV/bin/python" scripts/diffusers_suite.py --tests "$WORK" --shim "$SHARED" \
    --out "${DIFFUSERS_TESTS_OUT:-/tmp/fastload-diffusers-tests}" "$@"
