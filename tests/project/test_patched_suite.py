"""The runners of transformers' and diffusers' own tests (scripts/transformers_suite.py,
scripts/diffusers_suite.py, sharing scripts/patched_suite.py) judge by outcomes: a test that
passes unpatched must pass patched; they count the loads the patch served from its log."""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the runners import patched_suite from beside them

import diffusers_suite  # noqa: E402
import patched_suite as suite  # noqa: E402
import transformers_suite  # noqa: E402

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


def test_served_and_left_loads_are_counted_from_the_patchs_log_records(tmp_path: Path) -> None:
    records = tmp_path / "r.records"
    records.write_text(
        "INFO     fastload:patch.py:231 fastload served UNet2DModel.from_pretrained('/t/a')\n"
        "WARNING  fastload:patch.py:237 fastload: UNet2DModel.from_pretrained('/t/b') is left "
        "to diffusers: low_cpu_mem_usage=False\n"
        "INFO     fastload:patch.py:161 fastload served BertModel.from_pretrained('/t/c')\n"
        "WARNING  diffusers:x.py:1 something else is left to chance\n"
    )
    assert suite.served(records) == (2, 1)
    assert suite.served(tmp_path / "absent.records") == (0, 0)


@pytest.mark.parametrize("runner", [transformers_suite, diffusers_suite])
def test_an_unknown_family_is_refused_by_name(
    runner: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        runner.main(["--tests", "t", "--shim", "s", "--families", "nonesuch"])  # type: ignore[attr-defined]
    assert "nonesuch" in capsys.readouterr().err


def test_every_diffusers_family_is_in_the_shared_tests() -> None:
    shared = Path(os.environ.get("FASTLOAD_SHARED", SCRIPTS.parent.parent / "shared"))
    archive = shared / "diffusers-tests" / "diffusers-tests.tgz"
    if not archive.is_file():
        pytest.skip(f"{archive} is not there")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for family, target in diffusers_suite.FAMILIES.items():
        assert target in names, family
