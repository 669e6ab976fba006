"""Where a load's tensors come from: checkpoint files on disk, in object storage
(:mod:`fastload.core.store.object_store`), or an in-memory state dict.

All end as an :class:`~fastload.core.checkpoint.opened.OpenCheckpoint`, so the rest of the pipeline
does not tell them apart.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from fastload.core.basics import json_text
from fastload.core.basics.errors import RequestError
from fastload.core.checkpoint.files import CheckpointFiles, resolve
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor, open_checkpoint
from fastload.core.checkpoint.pickle_file import StateDictFile, is_pickle
from fastload.core.store import object_store

logger = logging.getLogger("fastload")


def open_source(
    checkpoint: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    read_mode: str,
    mmap: str,
    allow_pickle: bool,
    storage_options: Mapping[str, object] | None = None,
) -> OpenCheckpoint:
    """Opens a local checkpoint path (resolved by :func:`fastload.core.checkpoint.files.resolve`), a
    checkpoint in object storage (a URL, configured by ``storage_options``), or wraps an
    in-memory state dict, as the table of tensors the planner reads."""
    if object_store.is_url(checkpoint):
        assert isinstance(checkpoint, str)
        if mmap == "shared":
            raise RequestError(
                f"{checkpoint}: mmap='shared' needs local files; tensors from object storage "
                "are copies the engine fills"
            )
        if read_mode == "mmap":  # as load_file refuses it: never an option silently ignored
            raise RequestError(
                f"{checkpoint}: read_mode='mmap' needs local files; object storage is read "
                "with ranged GETs"
            )
        return object_store.open_checkpoint(checkpoint, storage_options)
    if storage_options is not None:
        raise RequestError(
            "storage_options apply to object storage URLs (s3://, gs://, az://, http(s)://), "
            "not to local files or a state dict"
        )
    if isinstance(checkpoint, Mapping):
        if mmap == "shared":
            raise RequestError("mmap='shared' needs safetensors files, not a state_dict")
        file = StateDictFile(dict(checkpoint))
        where = Path(file.path)
        ckpt = OpenCheckpoint(CheckpointFiles(directory=where, files=(where,)), [file])
        for name, st_dtype, shape, begin, end in file.tensors():
            ckpt.tensors[name] = StoredTensor(name, 0, st_dtype, tuple(shape), end - begin)
        return ckpt
    location = resolve(checkpoint, allow_pickle=allow_pickle)
    if mmap == "shared" and any(is_pickle(f) for f in location.files):
        # Sharing views safetensors data at its file offsets; a pickle has no such layout.
        raise RequestError(
            f"{location.index or location.files[0]}: mmap='shared' needs safetensors files; "
            "load this pickle checkpoint with mmap='copy', or convert it once with "
            "`fastload convert`"
        )
    _warn_if_one_shard(location)
    return open_checkpoint(location, read_mode)


def _warn_if_one_shard(location: CheckpointFiles) -> None:
    """One shard of a sharded checkpoint passed as a file loads only its own tensors; the index
    beside it would load them all. An index that names no other file (a one-shard index, as
    ``load_sharded_checkpoint`` needs) adds nothing: no warning then."""
    if location.index is not None or len(location.files) != 1:
        return
    shard = location.files[0]
    for index in sorted(shard.parent.glob("*.index.json")):
        if not index.is_file():  # a FIFO would block the read
            continue
        try:
            text = index.read_text(encoding="utf-8")
            weight_map = json_text.loads(text, index).get("weight_map", {})
            files = set(weight_map.values())
            listed = shard.name in files and len(files) > 1
        except (OSError, ValueError, AttributeError, TypeError):
            continue  # CheckpointError (too deep) is a ValueError: only a hint is lost
        if listed:
            logger.warning(
                "%s is one shard of a sharded checkpoint: only its own tensors are loaded; pass "
                "its index %s (or the directory) to load the whole checkpoint",
                shard,
                index,
            )
            return
