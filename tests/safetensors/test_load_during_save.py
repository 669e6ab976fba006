"""A load that overlaps a save into the same directory sees one checkpoint: all old or all new,
never a mix of shards, and no spurious failure when the two versions have different shard
layouts. Checked deterministically (a save published between opening the first and the second
shard, in every read mode) and with a saver process publishing two versions in a loop while
loads repeat."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fastload
from fastload.core.checkpoint import files as checkpoint
from fastload.core.checkpoint import opened as opening

MODES = [
    {"read_mode": "pread"},
    {"read_mode": "mmap"},
    {"mmap": "shared"},
]
MODE_IDS = ["pread", "mmap", "shared"]


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


def _version(value: float) -> Stack:
    model = Stack()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


#: version 1: four shards and an index; version 2: one model.safetensors
SHARDED, SINGLE = 1.0, 2.0
SHARD_SIZE = {SHARDED: 16 * 17 * 4, SINGLE: "5GB"}


def _save(directory: Path, value: float) -> None:
    fastload.save_pretrained(_version(value), directory, max_shard_size=SHARD_SIZE[value])


def _values(model: nn.Module) -> set[float]:
    return {v for p in model.parameters() for v in p.detach().unique().tolist()}


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    _save(out, SHARDED)
    assert (out / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture
def publish_after_first_shard(monkeypatch: pytest.MonkeyPatch, directory: Path) -> Iterator[None]:
    """Publishes the other version (single file) right after the load opens its first file."""
    real = opening._open_file
    published = []

    def open_then_publish(location: Any, path: Path, read_mode: str) -> Any:
        opened = real(location, path, read_mode)
        if not published:
            published.append(path)
            _save(directory, SINGLE)
        return opened

    monkeypatch.setattr(opening, "_open_file", open_then_publish)
    yield
    assert published, "the load never opened a file"


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_save_published_between_two_shards_gives_one_whole_version(
    directory: Path, publish_after_first_shard: None, mode: dict[str, str]
) -> None:
    model = fastload.from_pretrained(Stack, directory, **mode)
    assert len(_values(model)) == 1, f"a mix of versions: {sorted(_values(model))}"


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_index_read_before_a_save_still_finds_its_own_shards(
    directory: Path, monkeypatch: pytest.MonkeyPatch, mode: dict[str, str]
) -> None:
    # The save lands after the index is read and before any shard is opened: the shards the
    # index names come from the directory the index came from (the old version, all of it).
    real = checkpoint._resolve_index
    calls = []

    def resolve_then_publish(*args: Any) -> Any:
        out = real(*args)
        if not calls:
            calls.append(1)
            _save(directory, SINGLE)
        return out

    monkeypatch.setattr(checkpoint, "_resolve_index", resolve_then_publish)
    model = fastload.from_pretrained(Stack, directory, **mode)
    assert calls and len(_values(model)) == 1, sorted(_values(model))


SAVER = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    sys.path[:0] = sys.argv[2].split(os.pathsep)
    from test_load_during_save import SHARDED, SINGLE, _save
    directory, stop = Path(sys.argv[1]), Path(sys.argv[3])
    turn = 0
    while not stop.exists():
        _save(directory, (SHARDED, SINGLE)[turn % 2])
        turn += 1
        print(turn, flush=True)
    """
)

LOADS = 2000


def test_loads_repeated_while_another_process_publishes_two_layouts_never_mix(
    directory: Path, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    saver = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SAVER,
            str(directory),
            os.pathsep.join(
                [str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")]
            ),
            str(stop),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout is not None
        saver.stdout.readline()  # the saver is running: its first save is published
        seen: Counter[str] = Counter()
        failures: list[str] = []
        for i in range(LOADS):
            mode = MODES[i % len(MODES)]
            try:
                model = fastload.from_pretrained(Stack, directory, progress=False, **mode)
            except fastload.FastloadError as e:
                failures.append(f"{MODE_IDS[i % len(MODES)]}: {e}")
                continue
            values = _values(model)
            seen["mix" if len(values) > 1 else f"version {values.pop()}"] += 1
    finally:
        stop.touch()
        saves = saver.communicate(timeout=60)[0].split()
    assert not failures, failures[:5]
    assert seen["mix"] == 0, seen
    # Both versions were loaded: the loads did overlap the saves.
    assert seen[f"version {SHARDED}"] > 0 and seen[f"version {SINGLE}"] > 0, seen
    print(f"{LOADS} loads, {len(saves)} saves published: {dict(seen)}")
