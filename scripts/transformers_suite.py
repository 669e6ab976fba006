"""transformers' own loading tests, unpatched and under ``fastload.patch_transformers()``.

Runs ``tests/utils/test_modeling_utils.py`` and the loading tests of each chosen model family
(``-k`` :data:`LOADING`) twice, as transformers alone and with the patch (``FASTLOAD_PATCH=1``,
through the ``shim`` plugin beside the tests), and fails when a test that passes unpatched does
not pass patched. Prints collected / passed / failed / skipped for both runs of each part.

Usage (scripts/transformers-tests.sh prepares the tests and their venv, then calls this):
    python scripts/transformers_suite.py --tests DIR --shim DIR [--families a,b,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: the families shared/transformers-tests ships
FAMILIES = (
    "mistral qwen2 qwen3 gemma gemma2 bart roberta distilbert mt5 umt5 olmoe qwen3_moe falcon phi "
    "gpt_neox"
).split()
#: the ``-k`` expression that selects a family's loading tests
LOADING = (
    "save or load or pretrained or tied or fp32 or mismatched or safetensors or from_pretrained "
    "or init"
)


def outcomes(junit: Path) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped"}`` from a pytest junit XML file."""
    result: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            result[name] = "failed"
        elif "skipped" in tags:
            result[name] = "skipped"
        else:
            result[name] = "passed"
    return result


def run(tests: Path, shim: Path, target: str, k: str | None, patched: bool, out: Path) -> Path:
    """One pytest run of ``target`` (a path under ``tests``); returns its junit XML file."""
    label = target.replace("/", "_") + ("-patched" if patched else "-unpatched")
    junit = out / f"{label}.xml"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        # the shim first; then this checkout's fastload (scripts/_env.sh's use_checkout)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])),
    }
    env.pop("FASTLOAD_PATCH", None)
    if patched:
        env["FASTLOAD_PATCH"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-p", "shim", "-o", "addopts=", "-q", "-p",
           "no:cacheprovider", f"--junitxml={junit}", target]  # fmt: skip
    if k:
        cmd += ["-k", k]
    print(f"[transformers-tests] {'patched  ' if patched else 'unpatched'} {target}", flush=True)
    with open(out / f"{label}.log", "w") as log:
        done = subprocess.run(cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT)
    # 0: all passed, 1: some failed (expected unpatched too), 5: nothing collected
    if done.returncode not in (0, 1, 5) or not junit.exists():
        raise SystemExit(f"pytest could not run {target} (exit {done.returncode}): see {log.name}")
    return junit


def regressions_of(unpatched: dict[str, str], patched: dict[str, str]) -> list[str]:
    """The tests that pass unpatched and do not pass patched (failed, skipped or not collected),
    sorted."""
    return sorted(t for t, o in unpatched.items() if o == "passed" and patched.get(t) != "passed")


def counts(result: dict[str, str]) -> str:
    n = {o: sum(v == o for v in result.values()) for o in ("passed", "failed", "skipped")}
    passed, failed, skipped = n["passed"], n["failed"], n["skipped"]
    return f"{len(result)} collected, {passed} passed, {failed} failed, {skipped} skipped"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests", type=Path, required=True, help="the unpacked transformers tree")
    p.add_argument("--shim", type=Path, required=True, help="the folder holding shim.py")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default all)")
    p.add_argument("--out", type=Path, default=Path("transformers-tests-results"))
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    parts = [("tests/utils/test_modeling_utils.py", None)] + [
        (f"tests/models/{f}/test_modeling_{f}.py", LOADING) for f in families
    ]
    regressions: list[str] = []
    lines: list[str] = []
    for target, k in parts:
        before = outcomes(run(args.tests, args.shim, target, k, False, args.out))
        after = outcomes(run(args.tests, args.shim, target, k, True, args.out))
        lost = regressions_of(before, after)
        regressions += lost
        lines.append(f"{target}\n  unpatched: {counts(before)}\n  patched:   {counts(after)}")
        if lost:
            lines.append("  passes unpatched, not patched:\n    " + "\n    ".join(lost))
    print("\n".join(lines))
    total = "every test that passes unpatched passes patched"
    print(
        f"[transformers-tests] {len(regressions)} regressions" if regressions else f"[ok] {total}"
    )
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
