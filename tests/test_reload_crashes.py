"""Faults that used to kill the process during ``fastload.reload`` instead of raising, run as a
user meets them: in a fresh interpreter, asserting on how it exits and what it prints.

- a shard truncated while a reload reads it, on a model loaded with ``read_mode="mmap"``: the
  reload read the new files through their mapping, where the truncation is a SIGBUS."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from torch import nn

import fastload
from fastload.core import reload as reload_module

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and mappings")

#: every child's wait, far above what it needs on a busy machine
BOUND = 300


def test_a_reload_reads_with_positioned_reads_whatever_read_mode_the_load_used(
    tmp_path, monkeypatch
):
    fastload.save_pretrained(nn.Linear(8, 8), tmp_path / "a")
    model = fastload.from_pretrained(
        lambda: nn.Linear(8, 8), tmp_path / "a", read_mode="mmap", progress=False
    )
    opened = []
    real = reload_module.open_source

    def spy(*args, **kwargs):
        ckpt = real(*args, **kwargs)
        opened.extend(f.mode for f in ckpt.files)
        return ckpt

    monkeypatch.setattr(reload_module, "open_source", spy)
    fastload.reload(model, tmp_path / "a")
    assert opened == ["pread"]


#: a model of 64 MiB in one shard, loaded with read_mode="mmap"; the new shard is truncated once
#: the reload's copy has begun (from the copy's progress callback)
_TRUNCATED = """
import json, os, sys
import torch
from torch import nn
import fastload
from fastload import _core
from fastload.core import reading

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(16)))

    def forward(self, x):
        return self.layers(x)

def made(seed):
    torch.manual_seed(seed)
    return Stack()

work, atomic = sys.argv[1], sys.argv[2] == "1"
fastload.save_pretrained(made(1), os.path.join(work, "a"))
fastload.save_pretrained(made(2), os.path.join(work, "b"))
model = fastload.from_pretrained(Stack, os.path.join(work, "a"), read_mode="mmap", progress=False)
real = reading.fill

def fill(file, items, threads=None, pool=None, progress=None):
    def cut(done):
        if done and os.path.getsize(file.path) > 200:
            os.truncate(file.path, 200)
    return real(file, items, 8, pool, _core.Progress(cut))

reading.fill = fill
try:
    fastload.reload(model, os.path.join(work, "b"), atomic=atomic)
    new = made(2).state_dict()
    out = {"ok": all(torch.equal(model.state_dict()[k], v) for k, v in new.items())}
except fastload.FastloadError as e:
    out = {"error": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
    try:
        model(torch.zeros(1, 1024))
        out["runs"] = True
    except fastload.ReloadError:
        out["runs"] = False
print(json.dumps(out))
"""


def _child(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )


@pytest.mark.parametrize("atomic", [False, True], ids=["in-place", "atomic"])
def test_a_shard_truncated_during_the_reload_of_a_mmap_model_is_an_error_not_a_sigbus(
    tmp_path, atomic
):
    done = _child(_TRUNCATED, tmp_path, int(atomic))
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "ok" in out:  # the copy was done before the file was cut: every byte is the new one
        assert out["ok"], out
        return
    shard = str(tmp_path / "b" / "model.safetensors")
    if atomic:  # the old weights whole
        assert out["error"] == "CheckpointError" and shard in out["message"], out
        assert "the model is unchanged" in "".join(out["notes"]), out
        assert out["runs"], out
    else:  # the tensors that may hold new bytes named, and the model refuses to run
        assert out["error"] == "ReloadError" and shard in out["message"], out
        assert not out["runs"], out
