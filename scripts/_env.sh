# Sourced by the scripts in this folder: a Python venv at a fixed path OUTSIDE the clone, created
# once and reused (torch is a multi-GB download), with the project's dependencies, and a helper
# that builds the Rust extension into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FASTLOAD_VENV="${FASTLOAD_VENV:-$HOME/.cache/fastload/venv}"
if [ ! -x "$FASTLOAD_VENV/bin/python" ]; then
    echo "fastload: creating the venv at $FASTLOAD_VENV (once; torch is downloaded once)" >&2
    mkdir -p "$(dirname "$FASTLOAD_VENV")"
    python3 -m venv "$FASTLOAD_VENV"
fi
# shellcheck disable=SC1091
source "$FASTLOAD_VENV/bin/activate"
if ! python -c "import maturin" 2>/dev/null && ! command -v maturin >/dev/null 2>&1; then
    pip install -q "maturin>=1.7,<2"
fi
command -v cargo >/dev/null || { echo "fastload: cargo (Rust) is required: https://rustup.rs" >&2; exit 1; }

# build_ext [dev|release]: builds the extension and installs the package (editable) with its test
# and documentation dependencies. pip only downloads what the venv lacks. A lock keeps parallel
# builds apart.
build_ext() {
    local profile="${1:-release}"
    local flags=()
    [ "$profile" = release ] && flags+=(--release)
    (cd "$ROOT" && flock /tmp/fastload-build.lock maturin develop -q "${flags[@]}" --extras test,docs) >&2
}
