"""Suite-wide test configuration.

Every test that needs a GPU carries the ``cuda`` marker, so a GPU machine runs exactly those with
``pytest -m cuda`` (``benches/cuda_check.py`` does). Tests are marked here from what they already
say: ``cuda`` or ``gpu`` in the test's name, or a ``skipif`` whose reason mentions CUDA or a GPU, so
a new GPU test needs no extra decoration to be found.
"""

from __future__ import annotations

import re

import pytest

_GPU_WORDS = re.compile(r"cuda|gpu", re.IGNORECASE)


def _needs_gpu(item: pytest.Item) -> bool:
    if _GPU_WORDS.search(item.name):
        return True
    return any(
        _GPU_WORDS.search(str(mark.kwargs.get("reason", "")))
        for mark in item.iter_markers("skipif")
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_gpu(item):
            item.add_marker(pytest.mark.cuda)
