"""The name users install fastload by: every documented `pip install` names this project's
distribution, and that name, resolved by pip against the sdist built from this checkout, gives
this project's metadata.

`pip install fastload` installs another project (a file downloader on PyPI that also installs a
top-level `fastload` module), so the distribution has a name of its own (pyproject.toml) and the
docs must never send a user to the other one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
#: the name of the unrelated project that owns "fastload" on PyPI
TAKEN = "fastload"

# `pip install [options] REQ...` in docs, scripts, workflows and messages
_PIP_INSTALL = re.compile(r"pip install((?:[ \t]+[^\s`'\"]+|[ \t]+\"[^\"]*\"|[ \t]+'[^']*')+)")
#: a line that names the other project on purpose, to warn about it
_WARNING = "another project"
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _places() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / ".github" / "workflows").glob("*.yml"))
    files += sorted((ROOT / "python" / "fastload").rglob("*.py"))
    files += sorted((ROOT / "scripts").glob("*"))
    return [f for f in files if f.is_file()]


def _documented_requirements() -> list[tuple[str, str]]:
    """(place, requirement) for each `pip install` argument that names a fastload distribution."""
    found = []
    for path in _places():
        text = path.read_text(encoding="utf-8", errors="replace")
        matches = (
            match
            for line in text.splitlines()
            if _WARNING not in line
            for match in _PIP_INSTALL.finditer(line)
        )
        for match in matches:
            for word in match.group(1).split():
                word = word.strip("\"'")
                if word.startswith(("-", ".", "/", "$")) or "fastload" not in word.lower():
                    continue
                name = _REQUIREMENT.match(word)
                if name is not None:
                    found.append((str(path.relative_to(ROOT)), name.group(0)))
    return found


def test_the_distribution_is_not_named_after_the_other_project() -> None:
    assert _normalized(PROJECT["name"]) != TAKEN


def test_every_documented_install_names_this_projects_distribution() -> None:
    found = _documented_requirements()
    # the README and the install page do tell users what to install
    assert {place for place, _ in found} >= {"README.md", "docs/install.md"}, found
    wrong = [(place, req) for place, req in found if _normalized(req) != PROJECT["name"]]
    assert not wrong, f"these install another distribution than {PROJECT['name']!r}: {wrong}"


def test_the_install_page_says_what_the_import_name_is_and_what_it_clashes_with() -> None:
    page = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    assert "import fastload" in page
    assert f"`pip install {TAKEN}` installs **{_WARNING}**" in page


def test_the_documented_name_resolves_to_this_checkouts_metadata(tmp_path: Path) -> None:
    """pip, asked for the documented name with only the sdist built from this checkout to
    choose from, finds it and reads this project's name and summary from its metadata (the
    metadata maturin writes at build time, not pyproject.toml read by this test)."""
    (name,) = {req for place, req in _documented_requirements() if place == "docs/install.md"}
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "maturin", "sdist", "--out", str(dist)]
    subprocess.run(build, cwd=ROOT, check=True, capture_output=True)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", name,
            # only the sdist: not PyPI, not the checkout's own metadata on PYTHONPATH
            "--no-index", "--find-links", str(dist), "--ignore-installed", "--no-deps",
            "--no-build-isolation", "--report", str(report),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (install,) = json.loads(report.read_text())["install"]
    metadata = install["metadata"]
    assert _normalized(metadata["name"]) == _normalized(name) == PROJECT["name"]
    assert metadata["summary"] == PROJECT["description"]
    assert metadata["version"] == PROJECT["version"]
    assert Path(install["download_info"]["url"].removeprefix("file://")).parent == dist
