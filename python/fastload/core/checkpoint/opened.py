"""An opened checkpoint: every file of a resolved checkpoint opened (headers validated by the
engine), and the table of the tensors they hold, checked against the index.

A tensor held by two files, or an index that disagrees with the shards' headers, is a
``CheckpointError``; a directory replaced while it was opened (a concurrent save) is resolved
again (:func:`~fastload.core.checkpoint.files.resolve`) and reopened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import main_floating_dtype, to_torch, torch_shape
from fastload.core.basics.engine import READ_MODES, TensorFile
from fastload.core.basics.errors import CheckpointError, FastloadIOError, RequestError
from fastload.core.checkpoint.files import ATTEMPTS, CheckpointFiles, resolve
from fastload.core.checkpoint.pickle_file import PickleFile, is_pickle


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the checkpoint: the file that holds it and its stored dtype and shape.

    ``shape`` is the header's, counting values; the tensor torch makes of the bytes has
    :attr:`torch_shape` (they differ for packed dtypes: an ``F4`` ``[8, 16]`` is a
    ``float4_e2m1fn_x2`` ``[8, 8]``)."""

    name: str
    file: int  # index into OpenCheckpoint.files
    st_dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: where its bytes begin in the file's data section (a safetensors header's offset)
    begin: int = 0

    @property
    def dtype(self) -> torch.dtype:
        """The stored torch dtype (``UnsupportedError`` if torch has none)."""
        return to_torch(self.st_dtype, where=f"tensor {self.name!r}")

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of the torch tensor holding it
        (:func:`~fastload.core.basics.dtypes.torch_shape`, the one mapping safetensors'
        ``load_file`` also makes; ``UnsupportedError`` for a packed tensor torch cannot hold)."""
        return tuple(torch_shape(self.st_dtype, list(self.shape), where=f"tensor {self.name!r}"))


@dataclass
class OpenCheckpoint:
    """A resolved checkpoint with every file opened (headers validated by the Rust core)."""

    location: CheckpointFiles
    files: list[TensorFile]
    tensors: dict[str, StoredTensor] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def file_path(self, tensor: StoredTensor) -> str:
        return self.files[tensor.file].path


def open_checkpoint(location: CheckpointFiles, read_mode: str = "pread") -> OpenCheckpoint:
    """Opens every file of ``location`` and builds the table of stored tensors.

    Safetensors files are opened with ``read_mode``, relative to the directory handle of
    ``location`` when it has one; pickle files, which :func:`resolve` returns only when allowed,
    with ``torch.load(weights_only=True)``. A tensor held by two files, or an index that disagrees
    with the shards' contents, is a ``CheckpointError``. If the directory was replaced and its
    files deleted meanwhile (a concurrent save), the checkpoint is resolved again and reopened.
    """
    if read_mode not in READ_MODES:  # checked even when only pickle files are opened
        raise RequestError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    for attempt in range(ATTEMPTS):
        try:
            return _open_once(location, read_mode)
        except (CheckpointError, FastloadIOError):
            handle, requested = location.handle, location.requested
            if (
                attempt + 1 == ATTEMPTS
                or handle is None
                or requested is None
                or not handle.replaced()
            ):
                raise
            location = resolve(requested[0], allow_pickle=requested[1])
    raise AssertionError("unreachable")  # pragma: no cover


def _open_file(location: CheckpointFiles, path: Path, read_mode: str) -> Any:
    if is_pickle(path):
        return PickleFile(path)
    if location.handle is None:
        return _core.SafetensorsFile(os.fspath(path), read_mode)
    name = path.relative_to(location.directory).as_posix()
    return _core.SafetensorsFile(os.fspath(path), read_mode, location.handle.fd, name)


def _open_once(location: CheckpointFiles, read_mode: str) -> OpenCheckpoint:
    opened = [_open_file(location, f, read_mode) for f in location.files]
    names = [f.relative_to(location.directory).as_posix() for f in location.files]
    return build_table(location, opened, names)


def build_table(
    location: CheckpointFiles, opened: list[TensorFile], shard_names: list[str]
) -> OpenCheckpoint:
    """The checkpoint of the ``opened`` files of ``location`` (``shard_names``: each one's name
    in the index): every tensor held by exactly one file, and the index, if any, agreeing with
    the files' headers (``CheckpointError`` otherwise)."""
    tensors: dict[str, StoredTensor] = {}
    for i, file in enumerate(opened):
        shard_name = shard_names[i]
        for name, st_dtype, shape, begin, end in file.tensors():
            if name in tensors:
                other = opened[tensors[name].file].path
                raise CheckpointError(
                    f"{file.path}: tensor {name!r} is also stored in {other} [duplicate-tensor]"
                )
            if location.weight_map is not None:
                listed = location.weight_map.get(name)
                if listed != shard_name:
                    where = f"in shard {listed!r}" if listed is not None else "nowhere"
                    raise CheckpointError(
                        f"{location.index}: shard {shard_name!r} holds tensor {name!r} but the "
                        f"index lists it {where} [index-mismatch]"
                    )
            tensors[name] = StoredTensor(name, i, st_dtype, tuple(shape), end - begin, begin)
    if location.weight_map is not None:
        for name, shard in location.weight_map.items():
            if name not in tensors:
                raise CheckpointError(
                    f"{location.index}: tensor {name!r} is listed in shard {shard!r}, whose header "
                    "does not contain it [index-mismatch]"
                )
    return OpenCheckpoint(location=location, files=opened, tensors=tensors)


def main_dtype(ckpt: OpenCheckpoint) -> torch.dtype | None:
    """The checkpoint's floating dtype holding the most bytes (``None``: none is floating), which
    the skeleton is built under unless a dtype is asked for."""
    return main_floating_dtype((t.st_dtype, t.nbytes) for t in ckpt.tensors.values())
