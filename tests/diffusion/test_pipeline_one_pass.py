"""A diffusers pipeline is one load under ``fastload.patch_diffusers()``.

A Stable Diffusion pipeline of a few MiB (UNet, VAE, CLIP text encoder), saved with
``save_pretrained``: every component's weight file is open (its read-ahead under way) before the
first component's tensors are swapped in, observed from outside the loader (the process's open
files, at the first swap); one progress bar over the pipeline in a fresh interpreter; every tensor
and one denoising step equal to diffusers' own load. With no memory to read ahead into, nothing is
read ahead (the files' pages in the page cache after the load, from ``mincore``) and the pipeline
is still the same.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from fresh import run_script  # noqa: E402
from tiny_pipelines import make_pipeline, same_pipeline, step  # noqa: E402

import fastload  # noqa: E402
from fastload.core import loading  # noqa: E402
from fastload.core.memory import budget as budgetmod  # noqa: E402
from fastload.core.memory.page_cache import evict, resident_fraction  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("one-pass")
    make_pipeline(tmp, larger=True).save_pretrained(tmp / "sd")
    return tmp / "sd"


def _weights(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*/*.safetensors"))
    assert {f.parent.name for f in files} == {"unet", "vae", "text_encoder"}
    return files


def _open_files() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def _load_watching_swaps(
    folder: Path, monkeypatch: pytest.MonkeyPatch, *, undo: bool = True
) -> tuple[Any, list[set[str]]]:
    """The pipeline loaded under the patch, and the files open at each component's swap."""
    seen: list[set[str]] = []
    swap_in = loading.swap_in

    def watching(*args: Any, **kwargs: Any) -> Any:
        seen.append(_open_files())
        return swap_in(*args, **kwargs)

    monkeypatch.setattr(loading, "swap_in", watching)
    for f in _weights(folder):
        evict(f)
        assert resident_fraction(f) < 0.05, f  # the load starts cold
    with fastload.patch_diffusers():
        pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    if undo:
        monkeypatch.undo()
    return pipe, seen


def test_every_components_files_are_read_ahead_before_the_first_swap_and_the_pipeline_is_diffusers(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, seen = _load_watching_swaps(saved, monkeypatch)
    assert len(seen) == 3  # one swap per model component
    weights = {str(f.resolve()) for f in _weights(saved)}
    assert weights <= seen[0], sorted(weights - seen[0])
    # read from the disk by the load: every page of every file is cached now
    assert all(resident_fraction(f) == 1.0 for f in weights)
    theirs = diffusers.DiffusionPipeline.from_pretrained(saved)
    same_pipeline(ours, theirs)
    assert torch.equal(step(ours), step(theirs))


def test_without_memory_to_read_ahead_into_nothing_is_read_ahead_and_the_pipeline_is_the_same(
    saved: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # files of its own: no mapping another test holds keeps their pages in the page cache
    saved = Path(shutil.copytree(saved, tmp_path / "sd"))
    # the OS says no memory is available (the budget's sources: no cgroup, MemAvailable 0)
    monkeypatch.setattr(budgetmod, "_cgroup_budget", lambda: None)
    monkeypatch.setattr(budgetmod, "_meminfo", lambda: {"MemAvailable": 0, "SwapFree": 0})
    ours, seen = _load_watching_swaps(saved, monkeypatch, undo=False)
    weights = _weights(saved)
    resident = sum(resident_fraction(f) * f.stat().st_size for f in weights)
    monkeypatch.undo()
    assert len(seen) == 3
    # no read-ahead of the pipeline: at the first swap, the other components' files are not open
    assert not {str(f.resolve()) for f in weights} <= seen[0]
    # and their pages were not read: the first tensors of each (read ahead of the first forward,
    # fastload.core.memory.paced) and the kernel's own read-ahead around them at most
    assert resident < 0.5 * sum(f.stat().st_size for f in weights)
    theirs = diffusers.DiffusionPipeline.from_pretrained(saved)
    same_pipeline(ours, theirs)
    assert torch.equal(step(ours), step(theirs))


_BAR_SCRIPT = """
import sys
import diffusers
import fastload
from fastload.core.basics import progress

progress.PROGRESS_MIN_BYTES = 0  # a bar for this small pipeline, though stderr is no terminal
with fastload.patch_diffusers():
    diffusers.DiffusionPipeline.from_pretrained(sys.argv[1])
print("loaded")
"""


def test_one_progress_bar_over_the_pipeline(saved: Path, tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    code = _BAR_SCRIPT.replace("print(", "sys.stderr.flush(); print(")
    out = run_script(
        f"import sys; sys.stderr = open({str(err)!r}, 'w', buffering=1)\n" + code, saved
    )
    assert out.strip() == "loaded"
    text = err.read_text()
    # every bar's label (tqdm: "label:  42%|###   |"), once per bar however often it is redrawn
    labels = {m.group(1).strip() for m in re.finditer(r"(?:^|[\r\n])([^\r\n|]*?):\s+\d+%\|", text)}
    assert labels == {"fastload: StableDiffusionPipeline"}, text
    last = [m.group(0) for m in re.finditer(r"100%\|[^\r\n]*", text)]
    assert last, text  # the bar reached the pipeline's total


def _mapped_paths() -> set[str]:
    """The files whose pages this process has mapped (``/proc/self/smaps``: resident pages of
    their mappings; an address range reserved for a file, with none of its pages, is not)."""
    out, path = set(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
            path = fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
        elif fields[0] == "Rss:" and path is not None and int(fields[1]) > 0:
            out.add(path)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_read_ahead_maps_the_files_of_loads_that_make_views_and_only_those(
    saved: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dtype: torch.dtype
) -> None:
    # files of its own, read cold: no other test's mapping of them
    saved = Path(shutil.copytree(saved, tmp_path / "sd"))
    weights = {str(f.resolve()) for f in _weights(saved)}
    for f in weights:
        evict(Path(f))
    mapped: list[set[str]] = []
    swap_in = loading.swap_in

    def watching(*args: Any, **kwargs: Any) -> Any:
        # once the session's helper is through every file (its work, not the loads')
        for thread in threading.enumerate():
            if thread.name == "fastload-session-read-ahead":
                thread.join()
        mapped.append(_mapped_paths() & weights)
        return swap_in(*args, **kwargs)

    monkeypatch.setattr(loading, "swap_in", watching)
    with fastload.patch_diffusers():
        ours = diffusers.DiffusionPipeline.from_pretrained(saved, torch_dtype=dtype)
    monkeypatch.undo()
    after = _mapped_paths() & weights
    assert len(mapped) == 3
    assert all(resident_fraction(Path(f)) == 1.0 for f in weights)  # read ahead, all of them
    if dtype == torch.float32:  # stored: views, every file mapped as it was read
        assert mapped[0] == weights
        assert after == weights  # the views keep their mappings
    else:  # converted: copies from the page cache, no page of a file mapped at any time
        assert mapped == [set(), set(), set()]
        assert after == set()
    theirs = diffusers.DiffusionPipeline.from_pretrained(saved, torch_dtype=dtype)
    same_pipeline(ours, theirs)
