"""Faults that used to kill the process during ``fastload.reload`` instead of raising, run as a
user meets them: in a fresh interpreter, asserting on how it exits and what it prints.

- a shard truncated while a reload reads it, on a model loaded with ``read_mode="mmap"``: the
  reload read the new files through their mapping, where the truncation is a SIGBUS;
- ``atomic=True`` in a memory cgroup, on a model whose weights are views of its file's mapping
  (the default CPU load): the check counted the staged copies only, and the commit's writes into
  the views copy every page (copy-on-write), so the child was OOM-killed after the check had
  passed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from memory_cgroup import baseline_bytes, needs_memory_cgroup, run_in_cgroup
from torch import nn

import fastload
from fastload.core.memory.budget import MemoryBudget, copy_on_write_bytes
from fastload.core.memory.page_cache import evict
from fastload.reloading import guard as reload_guard
from fastload.reloading import in_place as reload_module

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
from fastload.core.reads import reading
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


#: 16 fp32 2048x2048 layers: 256 MiB of weights, in one file
LAYERS, WIDTH = 16, 2048
MODEL_BYTES = LAYERS * WIDTH * WIDTH * 4

#: loads argv[1] (views of its mapping, the default), then reloads argv[2] with atomic=True
_ATOMIC = """
import json, sys
import torch
from torch import nn
import fastload

def stack():
    return nn.Sequential(*(nn.Linear(@WIDTH@, @WIDTH@, bias=False) for _ in range(@LAYERS@)))

model, report = fastload.from_pretrained(
    stack, sys.argv[1], progress=False, output_loading_info=True
)
views = report.summary()
try:
    fastload.reload(model, sys.argv[2], atomic=True)
except fastload.MemoryBudgetError as e:
    print(json.dumps({"refused": str(e), "views": views}))
    sys.exit(0)
with torch.inference_mode():
    out = model(torch.ones(1, @WIDTH@))
print(json.dumps({"reloaded": True, "sum": float(out.sum()), "views": views}))
""".replace("@LAYERS@", str(LAYERS)).replace("@WIDTH@", str(WIDTH))


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory):
    where = tmp_path_factory.mktemp("atomic_cgroup")
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = {f"{i}.weight": torch.randn(WIDTH, WIDTH) * 0.02 for i in range(LAYERS)}
        path = where / f"stack-{seed}.safetensors"
        fastload.save_file(state, path)
        out.append(path)
    return out


@needs_memory_cgroup
def test_atomic_on_views_is_refused_when_staging_and_copy_on_write_do_not_fit(stacks):
    a, b = stacks
    base = baseline_bytes()
    # room for the staged copies (256 MiB) and 128 MiB more, not for the commit's copy of every
    # page of the views (256 MiB more)
    for path in stacks:
        evict(path)
    child = run_in_cgroup(_ATOMIC, a, b, limit=base + MODEL_BYTES * 3 // 2)
    assert not child.oom_killed, child.stderr[-3000:]
    got = child.json()
    assert "refused" in got, got
    assert "copy-on-write views" in got["refused"] and "Refused before reading" in got["refused"]
    # with room for both, the same reload commits
    for path in stacks:
        evict(path)
    child = run_in_cgroup(_ATOMIC, a, b, limit=base + MODEL_BYTES * 5 // 2)
    assert not child.oom_killed, child.stderr[-3000:]
    got = child.json()
    assert got.get("reloaded"), got
    fresh, old = (run_in_cgroup(_FRESH, path, limit=None).json()["sum"] for path in (b, a))
    assert abs(got["sum"] - fresh) <= 1e-4 * max(1.0, abs(fresh)), (got, fresh)
    assert abs(old - fresh) > 1e-2 * max(1.0, abs(fresh))  # else the check above proves nothing


#: argv[1] loaded anew: the output a reload into it must give
_FRESH = """
import json, sys
import torch
from torch import nn
import fastload

def stack():
    return nn.Sequential(*(nn.Linear(@WIDTH@, @WIDTH@, bias=False) for _ in range(@LAYERS@)))

model = fastload.from_pretrained(stack, sys.argv[1], progress=False)
with torch.inference_mode():
    out = model(torch.ones(1, @WIDTH@))
print(json.dumps({"sum": float(out.sum())}))
""".replace("@LAYERS@", str(LAYERS)).replace("@WIDTH@", str(WIDTH))


def _spans(model: nn.Module) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in model.state_dict().values()]


def layers() -> nn.Module:
    return nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))


def test_the_check_counts_the_pages_the_commit_copies_out_of_views_not_those_of_copies(
    tmp_path, monkeypatch
):
    """The same check without a cgroup (a budget set by the test): a model of views needs its
    staged copies and as much again; a model of its own memory only the staged copies."""
    fastload.save_pretrained(layers(), tmp_path / "a")
    fastload.save_pretrained(layers(), tmp_path / "b")
    views = fastload.from_pretrained(layers, tmp_path / "a", progress=False)
    copies = fastload.from_pretrained(layers, tmp_path / "a", mmap="copy", progress=False)
    nbytes = sum(t.nbytes for t in views.state_dict().values())
    assert nbytes <= copy_on_write_bytes(_spans(views)) <= nbytes + 2 * 4096 * 16
    assert copy_on_write_bytes(_spans(copies)) == 0
    budget = MemoryBudget(nbytes * 3 // 2, "test budget")
    monkeypatch.setattr(reload_guard, "memory_budget", lambda: budget)
    with pytest.raises(fastload.MemoryBudgetError, match="copy-on-write views") as info:
        fastload.reload(views, tmp_path / "b", atomic=True)
    assert "Refused before reading" in str(info.value) and "test budget" in str(info.value)
    fastload.reload(copies, tmp_path / "b", atomic=True)
    # the pages a reload wrote are the process's own: the next atomic reload copies none
    fastload.reload(views, tmp_path / "b")
    assert copy_on_write_bytes(_spans(views)) == 0
    fastload.reload(views, tmp_path / "a", atomic=True)
