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
from typing import Any

import pytest

# fixtures of the patch's tests (tests/support/patching.py): ``unpatched``, ``transformers_loads``;
# of the object storage tests (tests/support/s3_fixtures.py): ``server``, ``env`` (a module may
# define its own)
pytest_plugins = ["patching", "s3_fixtures"]

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
    parser.addoption(
        "--zoo-types",
        default="",
        metavar="PATTERNS",
        help="with --zoo: only the zoo types matching these comma-separated glob patterns "
        "(e.g. '[a-f]*,llava*'), to run the sweep in pieces",
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


def zoo_summary(reports: list[pytest.TestReport]) -> list[str]:
    """The zoo sweep's counts: cells equal to transformers, cells with a documented deliberate
    difference, skipped and failed cells; types equal in every cell they ran."""
    cells: dict[str, str] = {}
    type_of: dict[str, str] = {}
    types: dict[str, set[str]] = {}
    differences: dict[str, int] = {}
    for report in reports:
        props = dict(report.user_properties)
        model_type = props.get("zoo_type")
        if model_type is None:
            continue
        found = [v for k, v in report.user_properties if k == "zoo_difference"]
        if report.failed:
            outcome = "failed"
        elif report.skipped:
            outcome = "skipped"
        elif report.when != "call":
            continue
        else:
            outcome = "different" if found else "equal"
        if cells.get(report.nodeid) == "failed":
            continue  # a teardown after a failed call
        cells[report.nodeid] = outcome
        type_of[report.nodeid] = model_type
        for text in set(found):
            differences[text] = differences.get(text, 0) + 1
    for nodeid, outcome in cells.items():
        types.setdefault(type_of[nodeid], set()).add(outcome)
    if not cells:
        return []
    count = {o: sum(1 for v in cells.values() if v == o) for o in ("equal", "different")}
    count |= {o: sum(1 for v in cells.values() if v == o) for o in ("skipped", "failed")}
    ran = {t: o - {"skipped"} for t, o in types.items() if o - {"skipped"}}
    lines = [
        f"zoo: {len(cells)} cells: {count['equal']} equal to transformers, {count['different']} "
        f"with a documented difference, {count['skipped']} skipped, {count['failed']} failed",
        f"zoo: {len(types)} types, {len(ran)} with a cell run: "
        f"{sum(1 for o in ran.values() if o == {'equal'})} equal in every cell, "
        f"{sum(1 for o in ran.values() if 'failed' not in o and 'different' in o)} equal but "
        f"for documented differences, {sum(1 for o in ran.values() if 'failed' in o)} failing",
    ]
    lines += [
        f"zoo: documented difference {t!r}: {n} cells" for t, n in sorted(differences.items())
    ]
    return lines


def pytest_terminal_summary(terminalreporter: Any) -> None:
    reports = [
        r
        for key in ("passed", "failed", "skipped", "error")
        for r in terminalreporter.stats.get(key, [])
        if isinstance(r, pytest.TestReport)
    ]
    for line in zoo_summary(reports):
        terminalreporter.write_line(line)
