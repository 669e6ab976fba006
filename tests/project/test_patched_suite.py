"""The runner of transformers' own tests (scripts/transformers_suite.py) judges by outcomes: a
test that passes unpatched must pass patched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "transformers_suite.py"
_spec = importlib.util.spec_from_file_location("transformers_suite", SCRIPT)
assert _spec is not None and _spec.loader is not None
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.m.T" name="test_ok" time="0.1"/>
<testcase classname="tests.m.T" name="test_broken" time="0.1"><failure message="x"/></testcase>
<testcase classname="tests.m.T" name="test_crashed" time="0.1"><error message="y"/></testcase>
<testcase classname="tests.m.T" name="test_gpu" time="0.0"><skipped message="no gpu"/></testcase>
</testsuite></testsuites>
"""


def test_outcomes_are_read_from_pytest_junit_xml(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    junit.write_text(JUNIT)
    assert suite.outcomes(junit) == {
        "tests.m.T::test_ok": "passed",
        "tests.m.T::test_broken": "failed",
        "tests.m.T::test_crashed": "failed",
        "tests.m.T::test_gpu": "skipped",
    }


def test_a_test_passing_unpatched_that_fails_skips_or_vanishes_patched_is_a_regression() -> None:
    unpatched = {"a": "passed", "b": "passed", "c": "passed", "d": "failed", "e": "passed"}
    patched = {"a": "passed", "b": "failed", "c": "skipped", "d": "passed"}
    assert suite.regressions_of(unpatched, patched) == ["b", "c", "e"]


def test_failures_in_both_runs_are_not_regressions() -> None:
    assert suite.regressions_of({"a": "failed", "b": "skipped"}, {"a": "failed"}) == []
