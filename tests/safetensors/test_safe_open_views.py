"""``fastload.safe_open(...).get_tensor`` to the CPU in the stored dtype gives copy-on-write views
of the file, as ``safetensors.safe_open`` does (and as ``from_pretrained`` makes its parameters),
and reads a cold file ahead in parallel once a loop over its keys has asked for an eighth of it
(:mod:`fastload.safetensors.views`). Measured from outside: ``/proc/self/maps`` for where a
tensor lies, ``mincore(2)`` for what is in the page cache."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from process_maps import mapped_file
from safetensors.torch import save_file

import fastload
from fastload.core.memory.page_cache import evict, resident_fraction


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    # 16 tensors of 1 MiB (bf16), and a small f32 one
    state = {
        f"w{i:02d}": torch.randn(512, 1024, generator=gen).to(torch.bfloat16) for i in range(16)
    }
    state["scale"] = torch.randn(7, generator=gen)
    path = tmp_path / "model.safetensors"
    save_file(state, path)
    return path, state


def test_tensors_are_copy_on_write_views_of_the_file(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, state = checkpoint
    with fastload.safe_open(path, "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    for k, t in state.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        assert mapped_file(got[k].data_ptr()) == str(path.resolve()), k
    got["w00"].add_(1)  # writable; the write stays in this process's copy of the page
    with fastload.safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("w00"), state["w00"])


@pytest.mark.parametrize(
    "how",
    [{"mmap": "copy"}, {"read_mode": "pread"}, {"dtype": torch.float32}],
    ids=["mmap=copy", "read_mode", "converted"],
)
def test_a_copy_is_asked_for_by_mmap_copy_a_read_mode_or_a_dtype(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], how: dict[str, object]
) -> None:
    path, state = checkpoint
    dtype = how.pop("dtype", None)
    with fastload.safe_open(path, "pt", **how) as f:  # type: ignore[arg-type]
        t = f.get_tensor("w03", dtype=dtype)  # type: ignore[arg-type]
    assert mapped_file(t.data_ptr()) is None
    assert torch.equal(t, state["w03"].to(dtype or torch.bfloat16))


def test_a_bad_mmap_mode_is_refused(checkpoint: tuple[Path, dict[str, torch.Tensor]]) -> None:
    with pytest.raises(fastload.FastloadError, match="mmap"):
        fastload.safe_open(checkpoint[0], "pt", mmap="sometimes")


def _wait_resident(path: Path, at_least: float) -> float:
    """The file's resident fraction, once it reaches ``at_least`` (or after a minute)."""
    deadline = time.monotonic() + 60
    frac = resident_fraction(path)
    while frac < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
        frac = resident_fraction(path)
    return frac


def test_a_loop_over_a_cold_file_reads_it_ahead_and_one_tensor_does_not(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, state = checkpoint
    evict(path)
    if resident_fraction(path) > 0.05:
        pytest.skip("this filesystem keeps the file cached (no eviction)")
    with fastload.safe_open(path, "pt") as f:
        one = f.get_tensor("scale")  # 28 bytes of 16 MiB: no read-ahead
    assert torch.equal(one, state["scale"])
    time.sleep(0.5)
    assert resident_fraction(path) < 0.5
    evict(path)
    with fastload.safe_open(path, "pt") as f:
        views = {k: f.get_tensor(k) for k in f.keys()}  # nothing touched by this loop
        assert _wait_resident(path, 0.99) >= 0.99  # read ahead by the helper thread
    for k, t in state.items():
        assert torch.equal(views[k], t), k
