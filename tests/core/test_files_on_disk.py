"""Files that change or are not files: a checkpoint rewritten in place while it is read is
reported (``[file-changed]``), never returned torn; a FIFO, a device or a directory given as a
file is refused at once (``[not-regular-file]``), never waited on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file

import fastload
from fastload import _core
from fastload.core.basics.engine import copy_into

CHUNK = _core.CHUNK
N = 6 * CHUNK // 4  # F32 elements: six copy tasks


@pytest.fixture
def six_chunks(tmp_path: Path) -> Path:
    path = tmp_path / "w.safetensors"
    st_save_file({"w": torch.zeros(N)}, str(path))
    return path


def _rewrite_in_place(path: Path) -> None:
    """Overwrites the last bytes of the file with other values, size unchanged."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, torch.ones(1024).numpy().tobytes(), os.path.getsize(path) - 4096)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_a_file_rewritten_in_place_during_a_copy_is_reported_not_returned_torn(
    six_chunks: Path, mode: str
) -> None:
    file = _core.SafetensorsFile(str(six_chunks), mode)
    dest = torch.empty(N)
    rewrites = []

    def rewrite_once(done: int) -> None:
        if not rewrites:  # after the first task: the copy is under way
            rewrites.append(done)
            _rewrite_in_place(six_chunks)

    job = [("w", dest, "F32", None)]
    with pytest.raises(fastload.CheckpointError, match=r"\[file-changed\]") as err:
        copy_into(file, job, 1, _core.Progress(rewrite_once))
    assert rewrites and 0 < rewrites[0] < N * 4
    assert str(six_chunks) in str(err.value)


def test_a_file_rewritten_between_open_and_read_is_reported(six_chunks: Path) -> None:
    with fastload.safe_open(six_chunks) as f:
        _rewrite_in_place(six_chunks)
        with pytest.raises(fastload.CheckpointError, match=r"\[file-changed\]"):
            f.get_tensor("w")


def test_a_file_replaced_by_rename_during_a_load_is_still_read_whole(six_chunks: Path) -> None:
    # An atomic replace (what save_file does) leaves the open file intact: no false alarm.
    with fastload.safe_open(six_chunks) as f:
        other = six_chunks.with_name("other.safetensors")
        st_save_file({"w": torch.ones(N)}, str(other))
        other.replace(six_chunks)
        assert torch.equal(f.get_tensor("w"), torch.zeros(N))


REFUSE = textwrap.dedent(
    """
    import os, sys
    import fastload
    from fastload import _core
    path = sys.argv[1]
    calls = {
        "load_file": lambda: fastload.load_file(path),
        "safe_open": lambda: fastload.safe_open(path),
        "validate": lambda: _core.validate(path),
        "mmap": lambda: fastload.load_file(path, read_mode="mmap"),
    }
    for name, call in calls.items():
        try:
            call()
        except fastload.CheckpointError as e:
            print(name, "[not-regular-file]" in str(e) and path in str(e))
        else:
            print(name, "accepted")
    """
)


def _refusals(path: str) -> list[str]:
    # A subprocess with a timeout: a call that blocks in open(2) must fail the test, not hang it.
    out = subprocess.run(
        [sys.executable, "-c", REFUSE, path],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split("\n")[:-1]


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    assert _refusals(str(fifo)) == [
        "load_file True",
        "safe_open True",
        "validate True",
        "mmap True",
    ]


def test_a_character_device_and_a_directory_are_refused(tmp_path: Path) -> None:
    for path in ("/dev/zero", str(tmp_path)):
        assert _refusals(path) == [
            "load_file True",
            "safe_open True",
            "validate True",
            "mmap True",
        ], path


def test_from_pretrained_refuses_a_fifo_checkpoint_in_a_directory_and_given_directly(
    tmp_path: Path,
) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    os.mkfifo(tmp_path / "alone.safetensors")
    index = tmp_path / "sub"
    index.mkdir()
    os.mkfifo(index / "model.safetensors.index.json")
    for path in (tmp_path / "alone.safetensors", index / "model.safetensors.index.json"):
        with pytest.raises(fastload.CheckpointError, match=r"\[not-regular-file\]"):
            fastload.from_pretrained(torch.nn.Linear(2, 2), path)
    # In a directory a FIFO is not taken for the checkpoint file.
    with pytest.raises(fastload.CheckpointError, match="neither model.safetensors"):
        fastload.from_pretrained(torch.nn.Linear(2, 2), tmp_path)
