#!/usr/bin/env bash
# transformers' own loading tests, unpatched and under fastload.patch_transformers(): fails when a
# test that passes unpatched does not pass patched (scripts/transformers_suite.py).
# Usage: bash scripts/transformers-tests.sh [--families mistral,bart,...]   (default: all 15)
# The tests come from ../shared/transformers-tests (FASTLOAD_SHARED overrides ../shared). They
# need pytest 8.4 and a few plugins of their own: those go into a second venv beside the main one,
# which sees the main venv's packages (torch is not installed twice).
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
SHARED="${FASTLOAD_SHARED:-$ROOT/../shared}/transformers-tests"
if [ ! -f "$SHARED/transformers-tests.tgz" ]; then
    echo "transformers-tests: skipped, $SHARED/transformers-tests.tgz is not there" >&2
    exit 0
fi
use_checkout  # fastload from this checkout, also in the suite's venv (through PYTHONPATH)
python -c "import fastload._core" 2>/dev/null || build_ext release
TFT_VENV="$(side_venv tft)"  # the suite's pins first, then the main venv's packages
"$TFT_VENV/bin/python" -c "import pytest, parameterized, pytest_order, timeout_decorator, sentencepiece; assert pytest.__version__.startswith('8.4')" 2>/dev/null \
    || "$TFT_VENV/bin/pip" install -q "pytest==8.4.2" parameterized pytest-timeout pytest-env pytest-order timeout-decorator rich sentencepiece
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
tar xzf "$SHARED/transformers-tests.tgz" -C "$WORK"
mkdir -p "$WORK/src"
ln -sfn "$(python -c 'import transformers, os; print(os.path.dirname(transformers.__file__))')" "$WORK/src/transformers"
"$TFT_VENV/bin/python" scripts/transformers_suite.py --tests "$WORK" --shim "$SHARED" \
    --out "${TRANSFORMERS_TESTS_OUT:-/tmp/fastload-transformers-tests}" "$@"
