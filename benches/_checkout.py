"""This checkout's fastload, for a benchmark and for every process it starts (vLLM's engine and
workers): ``python/`` first on ``sys.path`` and on ``PYTHONPATH``, ahead of whatever a shared venv
holds (an editable install's ``fastload.pth`` points at the clone that made it). The extension and
the entry points come from ``bash scripts/vllm-env.sh`` (built into the checkout)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "python"


def use_this_checkout() -> None:
    """Puts :data:`SOURCES` first (idempotent); exits saying what to run where the extension is
    not built there."""
    if not any((SOURCES / "fastload").glob("_core*.so")):
        raise SystemExit(
            f"{SOURCES / 'fastload'}: no extension built in this checkout; run "
            "bash scripts/vllm-env.sh (it builds it here)"
        )
    if sys.path[:1] != [str(SOURCES)]:
        sys.path.insert(0, str(SOURCES))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if parts[:1] != [str(SOURCES)]:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SOURCES), *parts])
