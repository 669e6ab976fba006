# Use fastload from this checkout in the current shell, after `bash scripts/demo.sh` or
# `bash scripts/test.sh` has built it:
#
#     source scripts/activate.sh
#
# activates the shared venv (~/.cache/fastload/venv, or $FASTLOAD_VENV), puts this checkout's
# python/ first on PYTHONPATH (`import fastload` is this checkout's) and its .bin/ on PATH, where
# scripts/checkout_env.py writes the `fastload` command: a launcher that runs this checkout's
# fastload with the venv's python. Nothing of fastload is installed into the venv, which is shared by every clone
# (scripts/_env.sh); the launcher lives in the clone (ignored by git). `deactivate` undoes the venv.
# Sourced, not run: no `set -e` here, it would outlive this file in the user's shell.

_fastload_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
_fastload_venv="${FASTLOAD_VENV:-$HOME/.cache/fastload/venv}"
if [ ! -f "$_fastload_venv/bin/activate" ]; then
    echo "fastload: no venv at $_fastload_venv: run bash $_fastload_root/scripts/demo.sh first" >&2
elif ! ls "$_fastload_root"/python/fastload/_core*.so >/dev/null 2>&1; then
    echo "fastload: the extension is not built in $_fastload_root: run bash $_fastload_root/scripts/demo.sh first" >&2
else
    # shellcheck disable=SC1091
    . "$_fastload_venv/bin/activate"
    # the launcher (scripts/checkout_env.py writes it; again here if .bin/ was deleted)
    if [ ! -x "$_fastload_root/.bin/fastload" ]; then
        python "$_fastload_root/scripts/checkout_env.py" --launchers
    fi
    case ":${PYTHONPATH:-}:" in
        *":$_fastload_root/python:"*) ;;
        *) export PYTHONPATH="$_fastload_root/python${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    case ":$PATH:" in
        *":$_fastload_root/.bin:"*) ;;
        *) export PATH="$_fastload_root/.bin:$PATH" ;;
    esac
    hash -r 2>/dev/null || true
fi
unset _fastload_root _fastload_venv
