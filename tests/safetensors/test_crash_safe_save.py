"""A save_pretrained killed with SIGKILL over an existing checkpoint never leaves a mixed one.

A child process saves new weights over a checkpoint and is SIGKILLed at one of the save's steps:
no exception handler, no cleanup runs. The steps are found without knowing how the save publishes
its files: every return from the Rust writer (``_core.write_file``) and every ``os.fsync``,
``os.replace`` and ``os.rename`` call, counted in a run that is not killed. The test kills the
save at each of them in turn.

After each kill the directory must hold, bit for bit, either the old checkpoint (which must then
load as the old model) or the complete new one, and no other file a load would read: never a mix,
never a half-written ``*.safetensors``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import fastload

#: a limit that splits _model() into several shards (its weights are 8, 16 and 8 KiB)
SHARDED = 10_000
SINGLE = 5 * 10**9

# Saves _model(seed=1) over argv[1]; stops at step KILL_AT (1-based; 0 never stops), printing
# "ready <step>" and sleeping until killed. Prints "finished <number of steps>" otherwise.
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path[:0] = sys.argv[3].split(os.pathsep)
    from test_crash_safe_save import _model
    import fastload
    from fastload import _core

    stop_at = int(os.environ["KILL_AT"])
    steps = 0

    def step(name):
        global steps
        steps += 1
        if steps == stop_at:
            print(f"ready {name}", flush=True)
            time.sleep(600)

    def before(fn, name):
        def wrapper(*args, **kwargs):
            step(name)
            return fn(*args, **kwargs)
        return wrapper

    def after(fn, name):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            step(name)
            return out
        return wrapper

    os.fsync = before(os.fsync, "fsync")
    os.replace = before(os.replace, "replace")
    os.rename = before(os.rename, "rename")
    _core.write_file = after(_core.write_file, "write_file")
    fastload.save_pretrained(_model(seed=1), sys.argv[1], max_shard_size=int(sys.argv[2]))
    print(f"finished {steps}", flush=True)
    """
)


def _model(seed: int = 0) -> nn.Module:
    """A tiny MLP with seeded weights (also imported by the child process)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)
    )


def _weight_files(directory: Path) -> dict[str, bytes]:
    """Every file a load of ``directory`` could read, with its bytes."""
    return {
        p.name: p.read_bytes()
        for p in directory.iterdir()
        if p.is_file() and (p.name.endswith(".safetensors") or p.name.endswith(".index.json"))
    }


def _save_in_child(directory: Path, shard_size: int, kill_at: int) -> str:
    """Runs the child; with ``kill_at`` > 0 SIGKILLs it at that step. Returns its one line."""
    env = {**os.environ, "KILL_AT": str(kill_at)}
    # this test's module (the child imports its _model) and the tests' helpers
    tests_dir = os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")]
    )
    args = [sys.executable, "-c", _CHILD, str(directory), str(shard_size), tests_dir]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env) as child:
        try:
            line = child.stdout.readline().strip() if child.stdout else ""
        finally:
            if kill_at:
                child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
    if kill_at:
        assert line.startswith("ready"), f"the save never reached step {kill_at} ({line!r})"
        assert child.returncode == -signal.SIGKILL
    else:
        assert child.returncode == 0 and line.startswith("finished"), line
    return line


def _assert_loads_as(directory: Path, seed: int) -> None:
    loaded = fastload.from_pretrained(_model, directory, strict=True)
    want = _model(seed=seed).state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, want[name]), name


@pytest.mark.parametrize("shard_size", [SINGLE, SHARDED], ids=["single-file", "sharded"])
def test_a_save_killed_at_any_step_leaves_the_old_checkpoint_or_the_complete_new_one(
    tmp_path: Path, shard_size: int
) -> None:
    template = tmp_path / "template"
    fastload.save_pretrained(_model(seed=0), template, max_shard_size=shard_size)
    old = _weight_files(template)
    assert (len(old) > 1) == (shard_size == SHARDED)  # the sharded case really is sharded

    # An uninterrupted save: how many steps it takes, and what the new checkpoint is.
    reference = tmp_path / "reference"
    shutil.copytree(template, reference)
    steps = int(_save_in_child(reference, shard_size, kill_at=0).split()[1])
    new = _weight_files(reference)
    assert new != old and steps > 1

    outcomes = []
    for kill_at in range(1, steps + 1):
        directory = tmp_path / f"killed-at-{kill_at}"
        shutil.copytree(template, directory)
        where = _save_in_child(directory, shard_size, kill_at).removeprefix("ready ")
        after = _weight_files(directory)
        assert after in (old, new), f"killed before step {kill_at} ({where}): a mixed checkpoint"
        outcomes.append("old" if after == old else "new")
        if after == old:
            _assert_loads_as(directory, seed=0)
        shutil.rmtree(directory)
    # Kills before the save's single commit point leave the old checkpoint, kills after it the
    # new one; the first step (a file written under a temporary name) is always before it.
    assert outcomes[0] == "old"
    assert outcomes == sorted(outcomes, key=["old", "new"].index), outcomes


def test_a_completed_save_after_a_killed_one_loads_the_new_weights(tmp_path: Path) -> None:
    fastload.save_pretrained(_model(seed=0), tmp_path, max_shard_size=SHARDED)
    _save_in_child(tmp_path, SHARDED, kill_at=2)
    fastload.save_pretrained(_model(seed=1), tmp_path, max_shard_size=SHARDED)
    _assert_loads_as(tmp_path, seed=1)
    assert sorted(_weight_files(tmp_path)) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
