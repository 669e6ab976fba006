"""The load progress bar: per copied piece, switched off by the environment, binary units."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload
from fastload import _core
from fastload.core.basics.engine import copy_into
from fastload.core.basics.progress import DISABLE_VARS, binary_unit

CHUNK = _core.CHUNK


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(6 * CHUNK // 4))  # one F32 tensor of six chunks


@pytest.fixture
def wide(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    st_save_file({"w": torch.arange(6 * CHUNK // 4, dtype=torch.float32)}, str(path))
    return path


@pytest.fixture
def bar_updates(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The values every fastload bar is set to, with the bar forced on."""
    import tqdm.auto

    updates: list[float] = []
    real = tqdm.auto.tqdm

    class Recording(real):  # type: ignore[misc,valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            updates.append(self.n)
            return out

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    monkeypatch.setattr("fastload.core.basics.progress.PROGRESS_MIN_BYTES", 0)
    for var in DISABLE_VARS:
        monkeypatch.delenv(var, raising=False)
    return updates


def test_the_counter_reports_each_copied_piece_of_a_single_file(wide: Path) -> None:
    file = _core.SafetensorsFile(str(wide))
    dest = torch.empty(6 * CHUNK // 4)
    seen: list[int] = []
    progress = _core.Progress(seen.append)
    copy_into(file, [("w", dest, "F32", None)], 1, progress)
    # After every task (one chunk here) the callback gets the count; a slow machine may add
    # repeats from the periodic wake-ups, never a decrease.
    assert seen == sorted(seen)
    assert {n for n in seen if 0 < n < 6 * CHUNK} == {k * CHUNK for k in range(1, 6)}
    assert progress.done == 6 * CHUNK


def test_the_bar_moves_during_a_one_file_load_not_only_at_its_end(
    wide: Path, bar_updates: list[float]
) -> None:
    fastload.from_pretrained(Wide, wide, threads=1, progress=True, mmap="copy")
    unit, size = binary_unit(6 * CHUNK)
    assert unit == "MiB"
    steps = sorted({round(v * size) for v in bar_updates})
    assert steps[-1] == 6 * CHUNK
    assert len([s for s in steps if 0 < s < 6 * CHUNK]) >= 5, steps


def test_the_bar_labels_its_sizes_in_binary_units(
    wide: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("fastload.core.basics.progress.PROGRESS_MIN_BYTES", 0)
    for var in DISABLE_VARS:
        monkeypatch.delenv(var, raising=False)
    fastload.from_pretrained(Wide, wide, progress=True, mmap="copy")
    err = capsys.readouterr().err
    # 48 MiB = 50.3 MB: the figures are MiB and labelled so.
    assert "48.00/48.00 MiB" in err and "MB" not in err, err


@pytest.mark.parametrize("var", DISABLE_VARS)
def test_an_environment_switch_hides_the_bar(
    wide: Path,
    var: str,
    bar_updates: list[float],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(var, "1")
    fastload.from_pretrained(Wide, wide, progress=True, mmap="copy")
    assert bar_updates == [] and "fastload" not in capsys.readouterr().err


def test_a_false_environment_value_leaves_the_bar_on(
    wide: Path, bar_updates: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TQDM_DISABLE", "0")
    fastload.from_pretrained(Wide, wide, progress=True, mmap="copy")
    assert bar_updates


def test_binary_units_pick_the_largest_that_fits() -> None:
    assert binary_unit(3 << 30) == ("GiB", 1 << 30)
    assert binary_unit((1 << 30) - 1) == ("MiB", 1 << 20)
    assert binary_unit(1000) == ("KiB", 1 << 10)
