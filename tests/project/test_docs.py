"""The documentation: the site builds strictly (a broken link, anchor or API reference fails it),
and the pages say what the code says where both list the same things (the option tables, the
package tree). The README is a front page whose links lead into the site. The examples of every
page run in tests/project/test_readme_examples.py."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "python" / "fastload"
#: what `mkdocs build` needs: the `docs` extra
BUILD_MODULES = ("mkdocs", "material", "mkdocstrings_handlers.python", "griffe_sphinx")


def _section(page: Path, heading: str) -> str:
    """The text of ``page`` under ``heading`` (a ``## `` line), up to the next ``## `` heading."""
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    absent = [m for m in BUILD_MODULES if importlib.util.find_spec(m.split(".")[0]) is None]
    if absent:
        pytest.skip(f"the docs extra is not installed ({', '.join(absent)}): pip install '.[docs]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # the API reference was generated from the docstrings, not left as `::: name` lines
    reference = (tmp_path / "reference" / "fastload" / "index.html").read_text(encoding="utf-8")
    assert "Builds (or takes) a model and loads a safetensors checkpoint" in reference
    assert ":::" not in reference


def test_the_transformers_option_table_of_the_docs_is_the_code_s() -> None:
    from fastload.hf.options import markdown_table

    assert markdown_table() in _section(DOCS / "options.md", "transformers' options")


def test_the_fastload_option_table_lists_every_option_with_its_default() -> None:
    from fastload.core.plan.load_options import DEFAULTS

    rows = re.findall(
        r"^\| `(\w+)` \| `([^`]*)` \|", _section(DOCS / "options.md", "fastload's options"), re.M
    )
    assert [name for name, _ in rows] == list(DEFAULTS)
    assert {name: ast.literal_eval(default) for name, default in rows} == DEFAULTS


def test_the_architecture_page_names_every_module_of_the_package() -> None:
    tree = _section(DOCS / "architecture.md", "The package tree")
    modules = [
        p.relative_to(PACKAGE)
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    ]
    assert len(modules) > 50
    # each module by its file name, in the tree under its package's folder
    unnamed = [str(m) for m in modules if not re.search(rf"\b{re.escape(m.name)}\b", tree)]
    assert unnamed == []
    folders = {m.parent.name + "/" for m in modules if m.parent != Path(".")}
    assert {f for f in folders if f not in tree} == set()


def _mkdocs_setting(name: str) -> str:
    """A top-level string of mkdocs.yml (read as text: no YAML parser needed)."""
    found = re.search(rf"^{name}: (\S+)$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M)
    assert found, f"mkdocs.yml has no {name}"
    return found.group(1)


def _anchors(page: Path) -> set[str]:
    """The heading ids of a page, as Python-Markdown's toc extension makes them (its slugify on
    the heading's text, or an explicit ``{#id}``)."""
    ids = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M):
        explicit = re.search(r"\{\s*#([\w-]+)\s*\}", heading)
        if explicit:
            ids.add(explicit.group(1))
            continue
        text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
        ids.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower()))
    return ids


def test_the_readme_is_a_front_page_whose_links_work_off_the_repository() -> None:
    """The README is also the package page (PyPI), where nothing of the repository is beside it:
    every link is absolute, into the docs site (mkdocs.yml's site_url, a page of docs/ and a
    heading of it) or the repository (its repo_url, a file of this clone)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    site, repo = _mkdocs_setting("site_url"), _mkdocs_setting("repo_url")
    assert site.endswith("/") and not repo.endswith("/")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert [link for link in links if "://" not in link] == []
    into_site = [link for link in links if link.startswith(site)]
    assert len(into_site) >= 10
    broken = []
    for link in into_site:
        path, _, anchor = link[len(site) :].partition("#")
        page = DOCS / (f"{path.rstrip('/')}.md" if path else "index.md")
        if not page.exists():
            page = DOCS / path / "index.md"
        if not page.exists() or (anchor and anchor not in _anchors(page)):
            broken.append(link)
    for link in (link for link in links if link.startswith(repo + "/")):
        path = re.sub(r"^/(blob|tree)/main/", "", link[len(repo) :]).partition("#")[0]
        if path == link[len(repo) :] or not (ROOT / path).exists():
            broken.append(link)
    assert broken == []


def test_the_package_metadata_points_at_the_site_the_repository_and_the_changelog() -> None:
    tomllib = pytest.importorskip("tomllib")
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    repo = _mkdocs_setting("repo_url")
    assert urls["Documentation"] == _mkdocs_setting("site_url")
    assert urls["Repository"] == repo
    assert urls["Changelog"] == f"{repo}/blob/main/CHANGELOG.md"
    assert (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").startswith("# Changelog")
