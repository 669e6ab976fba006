"""A library's own tests, unpatched and under fastload's patch: the comparison both runners share.

Each part (a test file or folder, with an optional ``-k`` expression) is run twice with pytest,
as the library alone and with the patch (``FASTLOAD_PATCH=1``, through the ``shim`` plugin beside
the tests), and the run fails when a test that passes unpatched does not pass patched. For both
runs of each part it prints collected / passed / failed / skipped, and for the patched one how
many loads fastload served and how many it left to the library (counted from the patch's own log
records, ``fastload served ...`` and ``... is left to ...``, which pytest writes to a log file).

Used by scripts/transformers_suite.py and scripts/diffusers_suite.py (which the shell scripts
beside them call, in the venv they prepare).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path


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


def run(
    tests: Path, shim: Path, target: str, k: str | None, patched: bool, out: Path, name: str
) -> Path:
    """One pytest run of ``target`` (a path under ``tests``); returns its junit XML file (its
    output and its log records at INFO beside it, ``.log`` and ``.records``)."""
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
           "no:cacheprovider", f"--junitxml={junit}", f"--log-file={out / label}.records",
           "--log-file-level=INFO", target]  # fmt: skip
    if k:
        cmd += ["-k", k]
    print(f"[{name}] {'patched  ' if patched else 'unpatched'} {target}", flush=True)
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


def served(records: Path) -> tuple[int, int]:
    """``(served, left)``: the loads the patch served and left to the library in one run, from
    its log records (the patch logs each: ``fastload served`` at INFO, ``is left to`` warned)."""
    if not records.is_file():
        return 0, 0
    text = records.read_text(encoding="utf-8", errors="replace").splitlines()
    return (
        sum("fastload served " in line for line in text),
        sum(".from_pretrained(" in line and ") is left to " in line for line in text),
    )


def compare(
    parts: list[tuple[str, str | None]], tests: Path, shim: Path, out: Path, name: str
) -> int:
    """Runs every part unpatched and patched, prints the counts, and returns 1 when a test that
    passes unpatched does not pass patched (0 otherwise)."""
    out.mkdir(parents=True, exist_ok=True)
    regressions: list[str] = []
    lines: list[str] = []
    for target, k in parts:
        before = outcomes(run(tests, shim, target, k, False, out, name))
        junit = run(tests, shim, target, k, True, out, name)
        after = outcomes(junit)
        lost = regressions_of(before, after)
        regressions += lost
        n_served, n_left = served(junit.with_suffix(".records"))
        lines.append(
            f"{target}\n  unpatched: {counts(before)}\n  patched:   {counts(after)}"
            f" (fastload served {n_served} loads, left {n_left})"
        )
        if lost:
            lines.append("  passes unpatched, not patched:\n    " + "\n    ".join(lost))
    print("\n".join(lines))
    total = "every test that passes unpatched passes patched"
    print(f"[{name}] {len(regressions)} regressions" if regressions else f"[ok] {total}")
    return 1 if regressions else 0


def main(
    argv: list[str] | None,
    *,
    description: str,
    families: Mapping[str, str],
    k: str,
    name: str,
    first: tuple[str, ...] = (),
) -> int:
    """The command line of a runner: ``--tests DIR --shim DIR [--families a,b] [--out DIR]``;
    runs ``first`` (whole) then each chosen family's target (a path under the tests, with
    ``-k k``) through :func:`compare`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tests", type=Path, required=True, help="the unpacked tests tree")
    p.add_argument("--shim", type=Path, required=True, help="the folder holding shim.py")
    p.add_argument("--families", default=",".join(families), help="comma-separated (default all)")
    p.add_argument("--out", type=Path, default=Path(f"{name}-results"))
    args = p.parse_args(argv)
    chosen = [f for f in args.families.split(",") if f]
    unknown = sorted(set(chosen) - set(families))
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(families)}")
    parts: list[tuple[str, str | None]] = [(target, None) for target in first]
    parts += [(families[f], k) for f in chosen]
    return compare(parts, args.tests, args.shim, args.out, name)
