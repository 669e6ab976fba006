"""Test-suite options: the model zoo (``test_zoo.py``) runs whole only when asked."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--zoo",
        action="store_true",
        help="run the model-zoo parity test on every zoo model type, not only the fast subset",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Items marked `zoo` (zoo types outside the fast subset) run with --zoo or a -m naming zoo.
    if config.getoption("--zoo") or "zoo" in (config.getoption("markexpr") or ""):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("zoo") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
