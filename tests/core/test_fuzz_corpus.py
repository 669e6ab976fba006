"""Replays the corpus of the Python fuzz targets (``tests/fuzz``): every input, the hand-written
seeds and what libFuzzer kept, must give a result or a ``FastloadError``, nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parents[1] / "fuzz"
sys.path.insert(0, str(FUZZ))

from fuzz_json import TARGETS  # noqa: E402


def _cases() -> list[object]:
    return [
        pytest.param(name, path, id=f"{name}/{path.name}")
        for name in sorted(TARGETS)
        for path in sorted((FUZZ / "corpus" / name).iterdir())
    ]


def test_every_target_has_a_corpus() -> None:
    for name in TARGETS:
        assert any((FUZZ / "corpus" / name).iterdir()), name


@pytest.mark.parametrize(("target", "path"), _cases())
def test_a_corpus_input_gives_a_result_or_a_fastload_error(target: str, path: Path) -> None:
    TARGETS[target](path.read_bytes())
