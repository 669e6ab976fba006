"""Suite-wide test configuration.

Every test that needs a GPU carries the ``cuda`` marker, so a GPU machine runs exactly those with
``pytest -m cuda`` (``benches/cuda_check.py`` does). Tests are marked here from what they already
say: ``cuda`` or ``gpu`` in the test's name, or a ``skipif`` whose reason mentions CUDA or a GPU, so
a new GPU test needs no extra decoration to be found.

The model zoo (``test_zoo.py``) runs its fast subset by default; ``--zoo`` (or a ``-m`` naming
``zoo``) runs every zoo model type.
"""

from __future__ import annotations

import re

import pytest

# fixtures of the patch's tests (tests/patching.py): ``unpatched``, ``transformers_loads``
pytest_plugins = ["patching"]

_GPU_WORDS = re.compile(r"cuda|gpu", re.IGNORECASE)


def _needs_gpu(item: pytest.Item) -> bool:
    if _GPU_WORDS.search(item.name):
        return True
    return any(
        _GPU_WORDS.search(str(mark.kwargs.get("reason", "")))
        for mark in item.iter_markers("skipif")
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--zoo",
        action="store_true",
        help="run the model-zoo parity test on every zoo model type, not only the fast subset",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _needs_gpu(item):
            item.add_marker(pytest.mark.cuda)
    # Items marked `zoo` (zoo types outside the fast subset) run with --zoo or a -m naming zoo.
    if config.getoption("--zoo") or "zoo" in (config.getoption("markexpr") or ""):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("zoo") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
