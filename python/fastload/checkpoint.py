"""Resolving a checkpoint path into its safetensors files, and the table of tensors they hold.

A checkpoint is one ``.safetensors`` file, a directory holding ``model.safetensors``, or a sharded
checkpoint whose ``model.safetensors.index.json`` maps every tensor name to a shard file. The index
is checked strictly: shard names must stay inside the checkpoint directory, no tensor may be listed
twice, every listed shard must exist, and the index must agree with the shards' headers.

Pickle checkpoints (``pytorch_model.bin``, its sharded ``pytorch_model.bin.index.json``, ``.pt``
files) are refused with ``PickleRefusedError`` unless the caller allows them; then each is opened
as a :class:`~fastload.pickle_file.PickleFile` (``torch.load(weights_only=True)``) and its index is
checked by the same rules.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from fastload import _core
from fastload.dtypes import to_torch
from fastload.errors import (
    CheckpointError,
    PickleRefusedError,
    RequestError,
    from_os_error,
    os_error,
)
from fastload.pickle_file import PickleFile, is_pickle

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# In the order transformers prefers them.
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
_PICKLE_ADVICE = (
    "pass allow_pickle=True to load it with torch.load(weights_only=True), or convert it to "
    "safetensors once with `fastload convert`"
)


@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's files are, before any of them is opened.

    ``directory`` is where ``config.json`` and tokenizer files are looked for; ``files`` are the
    safetensors files in load order; ``index`` is the sharded index (``None`` for one file) and
    ``weight_map`` its tensor name -> file name table.
    """

    directory: Path
    files: tuple[Path, ...]
    index: Path | None = None
    weight_map: dict[str, str] | None = None
    index_metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the checkpoint: the file that holds it and its stored dtype and shape."""

    name: str
    file: int  # index into OpenCheckpoint.files
    st_dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        """The stored torch dtype (``UnsupportedError`` if torch has none)."""
        return to_torch(self.st_dtype, where=f"tensor {self.name!r}")


@dataclass
class OpenCheckpoint:
    """A resolved checkpoint with every file opened (headers validated by the Rust core)."""

    location: CheckpointFiles
    files: list[_core.SafetensorsFile | PickleFile]
    tensors: dict[str, StoredTensor] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def file_path(self, tensor: StoredTensor) -> str:
        return self.files[tensor.file].path


def resolve(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> CheckpointFiles:
    """Finds the checkpoint file(s) at ``path`` without opening them.

    Safetensors files are preferred; pickle files (``.bin``/``.pt``..., a directory holding
    ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``) are taken only with
    ``allow_pickle``. Raises ``FileNotFoundError`` (a ``FastloadIOError``) if ``path`` does not
    exist, ``PickleRefusedError`` for a pickle checkpoint that is not allowed, and
    ``CheckpointError`` for a directory with no checkpoint or a broken index.
    """
    p = Path(os.fspath(path))
    if not p.exists():
        raise os_error(p, errno.ENOENT)
    if p.is_file():
        if p.name.endswith(".index.json"):
            return _resolve_index(p, allow_pickle)
        if is_pickle(p) and not allow_pickle:
            raise PickleRefusedError(
                f"{p}: a pickle checkpoint, which could run code when loaded; {_PICKLE_ADVICE}"
            )
        return CheckpointFiles(directory=p.parent, files=(p,))
    single, index = p / SINGLE_FILE, p / INDEX_FILE
    if single.is_file():
        return CheckpointFiles(directory=p, files=(single,))
    if index.is_file():
        return _resolve_index(index, allow_pickle)
    for name in _PICKLE_FILES:
        if (p / name).is_file():
            if not allow_pickle:
                raise PickleRefusedError(
                    f"{p}: holds a pickle checkpoint ({name}) and no {SINGLE_FILE} or "
                    f"{INDEX_FILE}; {_PICKLE_ADVICE}"
                )
            if name.endswith(".index.json"):
                return _resolve_index(p / name, allow_pickle)
            return CheckpointFiles(directory=p, files=(p / name,))
    raise CheckpointError(f"{p}: neither {SINGLE_FILE} nor {INDEX_FILE} found in the directory")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key, out[key], value)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: str, first: Any, second: Any) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _check_shard_name(index: Path, shard: object) -> str:
    """``shard`` normalized, or ``CheckpointError`` if it is not a name inside the directory."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: shard name {shard!r} is not a file name")
    # Lexical check (no symlink resolution: hub caches link shards to blobs elsewhere).
    normal = posixpath.normpath(shard.replace("\\", "/"))
    escapes = (
        PurePosixPath(shard).is_absolute()
        or PureWindowsPath(shard).is_absolute()
        or bool(PureWindowsPath(shard).drive)
        or normal == ".."
        or normal.startswith("../")
        or normal.startswith("/")
        or "\x00" in shard
    )
    if escapes:
        raise CheckpointError(
            f"{index}: shard name {shard!r} escapes the checkpoint directory "
            "[shard-outside-directory]"
        )
    return posixpath.normpath(shard.replace("\\", "/"))


def _resolve_index(index: Path, allow_pickle: bool = False) -> CheckpointFiles:
    try:
        text = index.read_text(encoding="utf-8")
    except OSError as e:
        raise from_os_error(e, index) from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index}: not UTF-8 text ({e.reason})") from e
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as e:
        raise CheckpointError(
            f"{index}: tensor {e.key!r} is listed twice, in shards {e.first!r} and {e.second!r} "
            "[duplicate-tensor]"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to shards")
    weight_map: dict[str, str] = data["weight_map"]
    directory = index.parent
    # Shard names normalized ("sub/../x" is "x"), so one file is one shard however it is spelled.
    weight_map = {k: _check_shard_name(index, v) for k, v in weight_map.items()}
    shards = list(dict.fromkeys(weight_map.values()))
    pickled = [name for name in shards if is_pickle(name)]
    if pickled and not allow_pickle:
        raise PickleRefusedError(
            f"{index}: lists pickle shards ({pickled[0]!r}...), which could run code when "
            f"loaded; {_PICKLE_ADVICE}"
        )
    files = []
    for name in shards:
        f = directory / name
        if not f.is_file():
            raise CheckpointError(
                f"{index}: shard {name!r} is missing (looked for {f}) [missing-shard]"
            )
        files.append(f)
    metadata = data.get("metadata")
    return CheckpointFiles(
        directory=directory,
        files=tuple(files),
        index=index,
        weight_map=dict(weight_map),
        index_metadata=metadata if isinstance(metadata, dict) else None,
    )


def open_checkpoint(location: CheckpointFiles, read_mode: str = "pread") -> OpenCheckpoint:
    """Opens every file of ``location`` and builds the table of stored tensors.

    Safetensors files are opened with ``read_mode``; pickle files, which :func:`resolve` returns
    only when allowed, with ``torch.load(weights_only=True)``. A tensor held by two files, or an
    index that disagrees with the shards' contents, is a ``CheckpointError``.
    """
    from fastload.reader import READ_MODES, open_file

    if read_mode not in READ_MODES:  # checked even when only pickle files are opened
        raise RequestError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    opened = [PickleFile(f) if is_pickle(f) else open_file(f, read_mode) for f in location.files]
    tensors: dict[str, StoredTensor] = {}
    for i, file in enumerate(opened):
        shard_name = location.files[i].relative_to(location.directory).as_posix()
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
            tensors[name] = StoredTensor(name, i, st_dtype, tuple(shape), end - begin)
    if location.weight_map is not None:
        for name, shard in location.weight_map.items():
            if name not in tensors:
                raise CheckpointError(
                    f"{location.index}: tensor {name!r} is listed in shard {shard!r}, whose header "
                    "does not contain it [index-mismatch]"
                )
    return OpenCheckpoint(location=location, files=opened, tensors=tensors)
