#!/usr/bin/env bash
# The vLLM tests (tests/integrations/test_vllm.py) in the vLLM environment: made once at a fixed path outside
# the clone (scripts/vllm-env.sh, ~5 min and ~6 GB the first time), fastload built into this
# checkout and imported from it (PYTHONPATH: whichever clone used the venv last, these tests run
# this one's code; tests/integrations/test_vllm.py checks it). Usage: bash scripts/vllm-tests.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="$(bash "$ROOT/scripts/vllm-env.sh" | tail -n 1)"
cd "$ROOT"
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
# vLLM must be there: here a skip would hide a broken environment
"$py" -c "import vllm" 2>/dev/null || { echo "fastload: vLLM is missing from $py" >&2; exit 1; }
"$py" -m pytest tests/integrations/test_vllm.py tests/integrations/test_vllm_reload.py tests/integrations/test_vllm_quantized.py tests/integrations/test_vllm_share.py -p no:cacheprovider "$@"
