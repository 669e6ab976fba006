"""A reload's reads on one process: each file's fills through the copy engine.

CPU destinations are filled directly (:func:`fastload.core.reads.reading.fill`; the files in object
storage in one engine call, their requests in parallel), the others through the staging ring
(:func:`fastload.core.reads.streaming.stream_into`). A reload across ranks reads through the group's
collective read instead (:mod:`fastload.reloading.ranks`).
"""

from __future__ import annotations

from typing import Any

import torch

from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.memory.staging import StagingPool
from fastload.core.reads import reading as reader
from fastload.core.reads.streaming import stream_into
from fastload.core.store.object_store import is_remote

__all__ = ["fill_files"]


def _staged(device: torch.device) -> bool:
    """Whether destinations on ``device`` go through the staging ring (all but the CPU's)."""
    return device.type != "cpu"


def fill_files(
    ckpt: OpenCheckpoint,
    by_file: dict[int, list[reader.FillItem]],
    threads: int | None,
    started: list[int],
) -> None:
    """Fills every file's items, appending each file index to ``started`` before its first
    write; the files in object storage in one engine call (their requests in parallel)."""
    pool = StagingPool()
    try:
        deferred: list[int] = []
        for index in sorted(by_file):
            file = ckpt.files[index]
            items = [i for i in by_file[index] if not _staged(i[1].device)]
            if items and is_remote(file):
                deferred.append(index)
                continue
            started.append(index)
            if items:
                reader.fill(file, items, threads, pool)
            _stream(file, [i for i in by_file[index] if _staged(i[1].device)], threads, pool)
        if deferred:
            started.extend(deferred)
            work = [
                (ckpt.files[i], [t for t in by_file[i] if not _staged(t[1].device)])
                for i in deferred
            ]
            reader.fill_many(work, threads, pool)
            for index in deferred:
                items = [i for i in by_file[index] if _staged(i[1].device)]
                _stream(ckpt.files[index], items, threads, pool)
    finally:
        pool.release()


def _stream(file: Any, items: list[reader.FillItem], threads: int | None, pool: Any) -> None:
    """The staged path, one device per call; a non-contiguous target through a temporary."""
    by_device: dict[torch.device, list[reader.FillItem]] = {}
    for item in items:
        by_device.setdefault(item[1].device, []).append(item)
    for device_items in by_device.values():
        after = []
        ready: list[reader.FillItem] = []
        for name, target, selection in device_items:
            if not target.is_contiguous():
                tmp = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                after.append((target, tmp))
                target = tmp
            ready.append((name, target, selection))
        stream_into(file, ready, pool=pool, threads=threads)
        with torch.no_grad():
            for target, tmp in after:
                target.copy_(tmp)
