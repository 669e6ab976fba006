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

# The Rust extension is built into this checkout (python/fastload/_core.abi3.so) and fastload runs
# from it through PYTHONPATH, which precedes the venv's site-packages: nothing of fastload is
# installed into the venv, so the venv does not depend on which clone used it last (an editable
# install's fastload.pth would point at that clone). scripts/checkout_env.py writes the checkout's
# metadata (its entry points) beside its sources and installs the extras' dependencies.

# use_checkout: every process started from here on imports fastload from this checkout.
use_checkout() {
    [[ "${PYTHONPATH:-}" == "$ROOT/python" || "${PYTHONPATH:-}" == "$ROOT/python:"* ]] ||
        export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
}

# build_ext [dev|release] [EXTRAS]: builds the extension into this checkout, installs the
# dependencies of EXTRAS (default: test,docs; the demo asks for `demo` only) into the venv (pip
# only downloads what the venv lacks), writes the `fastload` launcher into .bin/ (what
# `source scripts/activate.sh` puts on PATH), and runs use_checkout. A lock keeps parallel builds
# apart.
build_ext() {
    local profile="${1:-release}" extras="${2:-test,docs}"
    local flags=()
    [ "$profile" = release ] && flags+=(--release)
    (cd "$ROOT" && flock /tmp/fastload-build.lock sh -c \
        'extras="$1"; shift; maturin develop -q --skip-install "$@" && python scripts/checkout_env.py --extras "$extras" --launchers' \
        sh "$extras" "${flags[@]}") >&2
    use_checkout
}

# side_venv NAME: the path of a second venv beside the main one, ${FASTLOAD_VENV}-NAME (made once),
# whose own packages (pins a suite needs) come first and the main venv's after them, through a
# .pth (torch is not installed twice); fastload itself is this checkout's (PYTHONPATH).
side_venv() {
    local venv="${FASTLOAD_VENV}-$1" main_site side_site
    main_site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    side_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "import site; site.addsitedir('$main_site')" > "$side_site/zz_fastload_main_venv.pth"
    echo "$venv"
}
