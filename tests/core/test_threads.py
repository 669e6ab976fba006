"""``threads=``: 1 to ``MAX_THREADS`` (256) on every load and save path, and copy thread pools
reused across calls, with a bounded number kept alive however many counts a process asks for."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload
from fastload import _core
from fastload.core.basics.engine import copy_into
from fastload.core.basics.threads import MAX_THREADS

BAD = [0, -1, MAX_THREADS + 1, 10_000, True, 2.0, "4"]


@pytest.fixture(scope="module")
def three_chunks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file of three copy tasks, so that a load with several threads uses a pool."""
    path = tmp_path_factory.mktemp("threads") / "model.safetensors"
    st_save_file({"w": torch.zeros(3 * _core.CHUNK // 4)}, str(path))
    return path


def _copy_threads() -> dict[int, str]:
    """Native thread id -> name of this process's copy-pool threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # the thread exited meanwhile
        if name.startswith("fastload-copy"):
            out[int(tid)] = name
    return out


@pytest.mark.parametrize("threads", BAD, ids=repr)
def test_a_thread_count_outside_the_range_is_refused_by_every_load_path(
    three_chunks: Path, threads: object
) -> None:
    calls = {
        "load_file": lambda: fastload.load_file(three_chunks, threads=threads),
        "safe_open": lambda: fastload.safe_open(three_chunks, threads=threads).get_tensor("w"),
        "from_pretrained": lambda: fastload.from_pretrained(
            nn.ParameterDict({"w": nn.Parameter(torch.empty(3 * _core.CHUNK // 4))}),
            three_chunks,
            threads=threads,
        ),
    }
    for name, call in calls.items():
        with pytest.raises(fastload.RequestError, match="threads must be an int from 1 to 256"):
            call()
        assert name


@pytest.mark.parametrize("threads", BAD, ids=repr)
def test_a_thread_count_outside_the_range_is_refused_by_the_save_paths_before_writing(
    tmp_path: Path, threads: object
) -> None:
    with pytest.raises(fastload.RequestError, match="threads"):
        fastload.save_file({"w": torch.zeros(4)}, tmp_path / "a.safetensors", threads=threads)
    with pytest.raises(fastload.RequestError, match="threads"):
        fastload.save_pretrained(nn.Linear(2, 2), tmp_path / "ckpt", threads=threads)
    assert list(tmp_path.iterdir()) == []


def test_the_engine_refuses_a_count_above_the_cap_itself(three_chunks: Path) -> None:
    file = _core.SafetensorsFile(str(three_chunks))
    out = torch.empty(3 * _core.CHUNK // 4)
    job = [("w", out, "F32", None)]
    with pytest.raises(fastload.RequestError, match=r"\[invalid-threads\]"):
        copy_into(file, job, MAX_THREADS + 1)
    with pytest.raises(fastload.RequestError, match=r"\[invalid-threads\]"):
        _core.write_file(str(three_chunks.with_name("x.safetensors")), [], None, 0)
    assert not three_chunks.with_name("x.safetensors").exists()


def test_the_largest_count_allowed_loads(three_chunks: Path) -> None:
    assert fastload.load_file(three_chunks, threads=MAX_THREADS)["w"].shape == (
        3 * _core.CHUNK // 4,
    )


def test_loading_again_with_the_same_count_reuses_the_same_threads(three_chunks: Path) -> None:
    fastload.load_file(three_chunks, threads=5)
    # Making the pool of 5 may have dropped the least recently used pool of an earlier test
    # (four are kept), whose threads exit on their own shortly after: wait for them to be gone
    # (a liveness wait, not a timing assertion), so that only live pools' threads are compared.
    first = set(_copy_threads())
    for _ in range(600):
        time.sleep(0.05)
        now = set(_copy_threads())
        if now == first:
            break
        first = now
    fastload.load_file(three_chunks, threads=5)
    assert first and _copy_threads().keys() >= first


def test_many_different_counts_leave_a_bounded_number_of_threads(three_chunks: Path) -> None:
    # Before: one pool per count, forever (2,080 threads after counts 1..64). Now at most four
    # pools are kept: counts 61..64 at most once each. A dropped pool's threads exit on their
    # own shortly after, so the count is polled (a liveness wait, not a timing assertion).
    for n in range(1, 65):
        fastload.load_file(three_chunks, threads=n)
    bound = 61 + 62 + 63 + 64
    alive = len(_copy_threads())
    for _ in range(600):  # up to ~30 s for the dropped pools' threads to exit
        if alive <= bound:
            break
        time.sleep(0.05)
        alive = len(_copy_threads())
    assert alive <= bound, f"{alive} copy threads alive"
