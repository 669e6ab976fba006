#!/usr/bin/env bash
# Re-vendors the upstream safetensors torch tests from a git clone of huggingface/safetensors:
#   bash tests/upstream_safetensors/vendor.sh /path/to/safetensors-clone [COMMIT]
# The only change made to the files is this import substitution (no assertion is touched):
#   from safetensors import ...        -> from st_shim import ...
#   from safetensors.torch import ...  -> from st_shim_torch import ...
#   from safetensors.numpy import ...  -> from st_shim_numpy import ...
set -euo pipefail
clone="$1"
commit="${2:-24b0b2857fef49be734b9ab72ce97c09bb25f5b9}"
here="$(cd "$(dirname "$0")" && pwd)"
for f in test_pt_comparison.py test_pt_model.py test_simple.py test_pread_backend.py; do
    git -C "$clone" show "$commit:bindings/python/tests/$f" |
        sed -E 's/^(\s*)from safetensors\.torch import /\1from st_shim_torch import /;
                s/^(\s*)from safetensors\.numpy import /\1from st_shim_numpy import /;
                s/^(\s*)from safetensors import /\1from st_shim import /' >"$here/$f"
done
git -C "$clone" show "$commit:LICENSE" >"$here/LICENSE"
