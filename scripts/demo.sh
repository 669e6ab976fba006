#!/usr/bin/env bash
# The main job: load a real model (all-MiniLM-L6-v2, shipped by a PyPI package) with fastload and
# with transformers, run a sentence through it, and print what was loaded and how fast.
source "$(dirname "$0")/_env.sh"
cd "$ROOT"
build_ext release
HF_HUB_OFFLINE=1 python -m fastload.tools.demo "$@"
