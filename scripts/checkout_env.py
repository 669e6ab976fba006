"""Makes a venv run fastload from the checkout that asks, whichever checkout used it before.

A venv shared by several clones (the scripts keep theirs at a fixed path outside the clone) must
not remember one of them: an editable install (``maturin develop``, ``pip install -e``) writes a
``fastload.pth`` into the venv pointing at the clone that ran it last, and every later run that
forgets to rebuild imports that clone's code, or a deleted one's. So nothing of fastload is
installed into the venv. Instead, with the venv's python::

    python scripts/checkout_env.py [--extras test,docs] [--launchers]

* writes the checkout's package metadata beside its sources,
  ``python/fastload_safetensors-<ver>.dist-info``
  (ignored by git): its entry points (``vllm.general_plugins``, the console script), which
  ``importlib.metadata`` finds on ``PYTHONPATH`` ahead of anything in the venv;
* with ``--launchers``, writes the console scripts (``fastload``) into the checkout's ``.bin/``
  (ignored by git): launchers that run this checkout's code with this venv's python, which
  ``source scripts/activate.sh`` puts on ``PATH`` (the venv's own ``bin/`` stays free of them);
* removes the ``fastload.pth`` an editable install left in the venv (it points at another clone);
* with ``--extras``, installs the runtime dependencies and those of the extras named, from this
  checkout's pyproject.toml, into the venv (pip is called only when the list changed).

The extension is built into the checkout beforehand (``maturin develop --skip-install``), and the
caller runs with ``PYTHONPATH=<checkout>/python`` (which precedes the venv's site-packages):
``scripts/_env.sh`` and ``scripts/vllm-env.sh`` do both.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def write_metadata(project: dict) -> Path:
    """``python/<name>-<version>.dist-info`` with the checkout's name, version and entry
    points, replacing any other version's (written aside, then renamed into place)."""
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in items.items()) + "\n"
        for group, items in groups.items()
    )
    name, version = project["name"], project["version"]
    python = ROOT / "python"
    # the folder is named by the normalized name, as an installed wheel's is (PEP 427, 503)
    target = python / f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}.dist-info"
    scratch = Path(tempfile.mkdtemp(prefix=".dist-info-", dir=python))
    (scratch / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: this checkout ({ROOT}), on PYTHONPATH\n"
    )
    (scratch / "entry_points.txt").write_text(entry_points)
    # every earlier one, whatever the project was named then (only this script writes them
    # here; two would declare the entry points twice)
    for old in python.glob("*.dist-info"):
        shutil.rmtree(old)
    scratch.rename(target)
    return target


_LAUNCHER = """#!{python}
# Written by scripts/checkout_env.py: `{name}` of the checkout {root}, run with the venv's python
# (nothing of fastload is installed into the venv). `source scripts/activate.sh` puts it on PATH.
import os
import sys

sources = {sources!r}
sys.path.insert(0, sources)
# the processes it starts (fresh interpreters) import the same checkout
path = os.environ.get("PYTHONPATH", "")
if sources not in path.split(os.pathsep):
    os.environ["PYTHONPATH"] = sources + (os.pathsep + path if path else "")
from {module} import {function}

sys.exit({function}())
"""


def write_launchers(project: dict) -> list[Path]:
    """``.bin/<script>`` for each console script of the project, for this interpreter."""
    folder = ROOT / ".bin"
    folder.mkdir(exist_ok=True)
    written = []
    for name, value in project.get("scripts", {}).items():
        module, _, function = value.partition(":")
        text = _LAUNCHER.format(
            python=sys.executable,
            name=name,
            root=ROOT,
            sources=str(ROOT / "python"),
            module=module,
            function=function,
        )
        target = folder / name
        scratch = folder / f".{name}.tmp"
        scratch.write_text(text)
        scratch.chmod(0o755)
        scratch.replace(target)
        written.append(target)
    return written


def remove_editable_pth() -> Path | None:
    """The venv's ``fastload.pth`` (an editable install's pointer at some clone), removed."""
    pth = Path(sysconfig.get_paths()["purelib"]) / "fastload.pth"
    if not pth.exists():
        return None
    pth.unlink()
    return pth


def install_dependencies(project: dict, extras: list[str]) -> None:
    """The runtime dependencies and those of ``extras``, installed into this interpreter's venv
    when this list was not installed already (a stamp in the venv, named by its hash)."""
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"checkout_env: no extra {unknown} in pyproject.toml")
    wanted = sorted({*project.get("dependencies", []), *(r for e in extras for r in optional[e])})
    digest = hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]
    stamp = Path(sys.prefix) / f".fastload-deps-{digest}"
    if stamp.exists():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted], check=True)
    stamp.touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="", help="extras whose dependencies to install")
    parser.add_argument(
        "--launchers",
        action="store_true",
        help="write the console scripts into .bin/, for this venv (scripts/_env.sh's venv; not "
        "the vLLM one, whose python the launchers would then run)",
    )
    args = parser.parse_args()
    if sys.prefix == sys.base_prefix:
        raise SystemExit("checkout_env: run it with a venv's python, not the system's")
    project = _pyproject()["project"]
    if args.extras:
        install_dependencies(project, args.extras.split(","))
    removed = remove_editable_pth()
    if removed is not None:
        print(f"checkout_env: removed {removed} (an editable install's pointer)", file=sys.stderr)
    write_metadata(project)
    if args.launchers:
        write_launchers(project)


if __name__ == "__main__":
    main()
