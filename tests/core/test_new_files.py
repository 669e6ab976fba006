"""Files fastload writes through a temporary name (the side files of ``fastload fetch`` and remote
``from_pretrained``, the companions of ``fastload convert``): never through a link planted in the
directory, a temporary name short enough for any final name, nothing left on failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastload.core.checkpoint import new_files
from fastload.tools.cli import main


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    directory = tmp_path / "dir"
    directory.mkdir()
    names = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(new_files.secrets, "token_hex", lambda n: next(names))
    planted = directory / f"{new_files.PREFIX}aaaaaaaa{new_files.SUFFIX}"
    planted.symlink_to(outside)
    dangling = directory / "dangling"
    dangling.symlink_to(tmp_path / "created-outside.txt")

    written = new_files.write_temporary(directory, b"new bytes")

    assert written.name == f"{new_files.PREFIX}bbbbbbbb{new_files.SUFFIX}"
    assert outside.read_text() == "precious" and planted.is_symlink()
    final = new_files.publish(written, dangling)  # a link at the final name is replaced
    assert not final.is_symlink() and final.read_bytes() == b"new bytes"
    assert not (tmp_path / "created-outside.txt").exists()


def test_the_temporary_name_fits_a_final_name_of_255_bytes(tmp_path):
    final = tmp_path / ("n" * 250 + ".json")
    assert len(final.name.encode()) == 255
    written = new_files.write_temporary(tmp_path, b"{}")
    assert len(written.name) <= 26
    assert new_files.publish(written, final).read_bytes() == b"{}"


def test_convert_never_writes_a_companion_through_a_link_planted_in_the_output(tmp_path: Path):
    source = tmp_path / "src"
    source.mkdir()
    torch.save({"w": torch.arange(4.0)}, source / "pytorch_model.bin")
    (source / "config.json").write_text('{"model_type": "bert"}')
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "outside" / "config.json"  # does not exist: a dangling link
    target.parent.mkdir()
    (out / "config.json").symlink_to(target)

    assert main(["convert", str(source), str(out)]) == 0

    assert not target.exists(), "convert wrote outside its directory through a link"
    assert (out / "config.json").is_symlink()  # left alone: it was there before
    assert not [p for p in os.listdir(out) if p.startswith(new_files.PREFIX)]


def test_a_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    class Boom(Exception):
        pass

    def fsync(fd: int) -> None:
        raise Boom

    monkeypatch.setattr(new_files.os, "fsync", fsync)
    with pytest.raises(Boom):
        new_files.write_temporary(tmp_path, b"x")
    assert list(tmp_path.iterdir()) == []


def _temporary_name(hex8: str) -> str:
    return f"{new_files.PREFIX}{hex8}{new_files.SUFFIX}"


def test_a_sweep_removes_the_leftovers_and_nothing_else(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    directory = tmp_path / "dir"
    directory.mkdir()
    leftover = directory / _temporary_name("0123abcd")  # what a killed writer left: no lock
    leftover.write_bytes(b"{")
    planted = directory / _temporary_name("deadbeef")
    planted.symlink_to(outside)
    (directory / _temporary_name("cafe")).write_text("not of its naming")
    (directory / "config.json").write_text("{}")
    (directory / _temporary_name("feedf00d")).mkdir()
    held = new_files.write_temporary(directory, b"being written")  # this process writes it

    assert new_files.sweep(directory) == [leftover]

    assert planted.is_symlink() and outside.read_text() == "precious"
    assert held.read_bytes() == b"being written"
    assert new_files.publish(held, directory / "new.json").read_bytes() == b"being written"
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [
            planted.name,
            _temporary_name("cafe"),
            "config.json",
            _temporary_name("feedf00d"),
            "new.json",
        ]
    )


def test_a_temporary_another_process_writes_is_swept_only_once_that_process_is_gone(tmp_path):
    # the lock is the kernel's: it goes when the process does, however it ends (SIGKILL here)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from fastload.core.checkpoint import new_files\n"
            "print(new_files.write_temporary(Path(sys.argv[1]), b'x'), flush=True)\n"
            "sys.stdin.read()\n",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        temporary = Path(writer.stdout.readline().strip())  # type: ignore[union-attr]
        assert temporary.exists()
        assert new_files.sweep(tmp_path) == []
        assert temporary.exists()
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    assert new_files.sweep(tmp_path) == [temporary]
    assert list(tmp_path.iterdir()) == []
