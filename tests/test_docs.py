"""The documentation: the site builds strictly (a broken link, anchor or API reference fails it),
and the pages say what the code says where both list the same things (the option tables, the
package tree). The README is a front page whose links lead into the site. The examples of every
page run in tests/test_readme_examples.py."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    from fastload.core.load_options import DEFAULTS

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


def test_the_readme_is_a_front_page_whose_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link.split("#")[0] for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    assert [link for link in local if not (ROOT / link).exists()] == []
