"""The tests run this checkout's fastload, in-process and in every process they start (a vLLM
server, a tensor-parallel rank, a user's script), not another clone's that a venv shared by several
clones may point at (an editable install's ``fastload.pth``): the scripts build the extension into
the checkout and run with ``PYTHONPATH=<checkout>/python`` (scripts/_env.sh,
scripts/vllm-env.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "python"

_PROBE = """
import importlib, json, sys
from importlib.metadata import entry_points

import fastload, fastload._core

groups = json.loads(sys.argv[1])
found = {}
for group, names in groups.items():
    for ep in entry_points(group=group):
        if ep.name in names:
            obj = ep.load()
            module = importlib.import_module(obj.__module__)
            found[f"{group}:{ep.name}"] = [ep.value, module.__file__]
print(json.dumps({"fastload": fastload.__file__, "core": fastload._core.__file__, "eps": found}))
"""


def _entry_points() -> dict[str, dict[str, str]]:
    """The entry points this checkout's pyproject.toml declares, by group."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    return groups


def _inside(path: str | None) -> bool:
    return path is not None and Path(path).resolve().is_relative_to(SOURCES)


def test_fastload_and_its_extension_are_imported_from_this_checkout() -> None:
    import fastload
    import fastload._core

    assert _inside(fastload.__file__), (fastload.__file__, SOURCES)
    assert _inside(fastload._core.__file__), (fastload._core.__file__, SOURCES)


def test_a_process_the_tests_start_runs_this_checkouts_fastload_and_entry_points(
    tmp_path: Path,
) -> None:
    # from another directory, as a vLLM worker or a user's script starts: only the environment
    # (PYTHONPATH) can lead it to this checkout
    groups = _entry_points()
    wanted = {group: list(items) for group, items in groups.items()}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(wanted)],
        cwd=tmp_path,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    where = f"PYTHONPATH={os.environ.get('PYTHONPATH')!r}"
    assert _inside(seen["fastload"]), (seen, SOURCES, where)
    assert _inside(seen["core"]), (seen, SOURCES, where)
    # every entry point the checkout declares is registered, as declared, and loads its code
    for group, items in groups.items():
        for name, value in items.items():
            key = f"{group}:{name}"
            assert key in seen["eps"], (
                f"entry point {key} is not registered: run bash scripts/vllm-env.sh or "
                f"build_ext of scripts/_env.sh ({seen['eps']})"
            )
            assert seen["eps"][key][0] == value, (key, seen["eps"][key], value)
            assert _inside(seen["eps"][key][1]), (key, seen["eps"][key], SOURCES, where)
