"""Saves tell their own temporary files from abandoned ones by a file lock, not a process id:
two savers that cannot see each other's processes (other containers, other NFS hosts: simulated
by a saver whose pid means nothing here) never delete each other's live files, and whatever a
killed save left (staging directory, temporary file, lock files) is removed by the next save."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

import fastload

# A saver in another process, paused inside its write until `go` exists. Its os.getpid() is
# replaced by a pid that is not alive here: what a process in another pid namespace or on
# another host looks like.
SAVER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    import fastload
    from fastload.safetensors import saving
    kind, target, go, fake_pid = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    os.getpid = lambda: fake_pid
    real = saving._write_new
    def paused(*args, **kwargs):
        out = real(*args, **kwargs)
        print("writing", flush=True)
        while not go.exists():
            time.sleep(0.01)
        return out
    saving._write_new = paused
    if kind == "pretrained":
        model = torch.nn.Linear(4, 4)
        torch.nn.init.constant_(model.weight, 7.0)
        fastload.save_pretrained(model, target)
    else:
        fastload.save_file({"w": torch.full((4,), 7.0)}, target)
    print("saved", flush=True)
    """
)


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(child.stdout)


def _start(kind: str, target: Path, go: Path) -> subprocess.Popen[str]:
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, kind, str(target), str(go), str(_dead_pid())],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert saver.stdout is not None
    assert saver.stdout.readline() == "writing\n"  # its temporary files exist and are locked
    return saver


def test_a_save_does_not_delete_the_staging_of_a_saver_whose_pid_it_cannot_see(
    tmp_path: Path,
) -> None:
    target, go = tmp_path / "ckpt", tmp_path / "go"
    fastload.save_pretrained(nn.Linear(4, 4), target)
    for trial in range(4):
        other = _start("pretrained", target, go)
        fastload.save_pretrained(nn.Linear(4, 4), target)  # sweeps for stale staging
        go.touch()
        out, _ = other.communicate(timeout=120)
        go.unlink()
        assert other.returncode == 0 and out.endswith("saved\n"), (trial, out)
        # The other saver published last: its checkpoint is the one on disk, whole.
        weight = fastload.load_file(target / "model.safetensors")["weight"]
        assert torch.equal(weight, torch.full((4, 4), 7.0))
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_the_next_save_pretrained_removes_what_killed_saves_left(tmp_path: Path) -> None:
    target, go = tmp_path / "ckpt", tmp_path / "go"
    fastload.save_pretrained(nn.Linear(4, 4), target)
    for _ in range(3):
        saver = _start("pretrained", target, go)
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        # Each saver swept what the one killed before it left: one staging and its lock remain.
        leftovers = sorted(n for n in os.listdir(tmp_path) if n != "ckpt")
        assert len(leftovers) == 2 and leftovers[1] == leftovers[0] + ".lock", leftovers
    fastload.save_pretrained(nn.Linear(4, 4), target)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_the_next_save_file_removes_the_temporary_files_killed_saves_left(tmp_path: Path) -> None:
    target, go = tmp_path / "model.safetensors", tmp_path / "go"
    for _ in range(3):
        saver = _start("file", target, go)
        saver.send_signal(signal.SIGKILL)
        saver.wait()
    # Each saver swept what the one killed before it left: one temporary file and its lock.
    leftovers = sorted(os.listdir(tmp_path))
    assert len(leftovers) == 2 and not target.exists(), leftovers
    # A temporary file of a fastload without locks (no lock file) is a leftover too.
    (tmp_path / ".model.safetensors.123-0123abcd.tmp").write_bytes(b"old leftover")
    fastload.save_file({"w": torch.zeros(2)}, target)
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_a_save_file_leaves_the_temporary_file_of_a_running_save_alone(tmp_path: Path) -> None:
    target, go = tmp_path / "model.safetensors", tmp_path / "go"
    other = _start("file", target, go)
    fastload.save_file({"w": torch.zeros(2)}, tmp_path / "other.safetensors")
    go.touch()
    out, _ = other.communicate(timeout=120)
    assert other.returncode == 0 and out.endswith("saved\n"), out
    assert sorted(os.listdir(tmp_path)) == ["go", "model.safetensors", "other.safetensors"]
