"""Resolving a checkpoint path into its files (:mod:`~fastload.core.checkpoint.opened` opens them).

A checkpoint is one ``.safetensors`` file, a directory holding ``model.safetensors``, or a sharded
checkpoint whose ``model.safetensors.index.json`` maps every tensor name to a shard file. The index
is checked strictly: shard names must stay inside the checkpoint directory, no tensor may be listed
twice, every listed shard must exist, and the index must agree with the shards' headers.

Pickle checkpoints (``pytorch_model.bin``, its sharded ``pytorch_model.bin.index.json``, ``.pt``
files) are refused with ``PickleRefusedError`` unless the caller allows them; then each is opened
as a :class:`~fastload.core.checkpoint.pickle_file.PickleFile` (``torch.load(weights_only=True)``)
and its index is checked by the same rules.

A load sees one checkpoint even while a save replaces it (``save_pretrained`` in this or another
process): the directory is opened once (:class:`DirHandle`) and the index and every shard are read
relative to that handle, so they all come from the same directory, whichever path names it now.
If the old directory is deleted under the load (the saver removes the tree it replaced), the
resolution starts over from the path, which then names the new checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import stat
import weakref
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from fastload.core.basics import json_text
from fastload.core.basics.errors import (
    CheckpointError,
    FastloadIOError,
    PickleRefusedError,
    from_os_error,
)
from fastload.core.checkpoint.pickle_file import is_pickle

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# In order of preference (the usual one for these names).
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
_PICKLE_ADVICE = (
    "pass allow_pickle=True to load it with torch.load(weights_only=True), or convert it to "
    "safetensors once with `fastload convert`"
)


#: how many times a resolution starts over when the directory was replaced under it
ATTEMPTS = 10


class DirHandle:
    """An open checkpoint directory; files are looked up relative to it (``openat``).

    ``save_pretrained`` replaces a checkpoint directory by exchanging it with a new one
    (``renameat2(RENAME_EXCHANGE)``): the handle keeps naming the directory that was opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags)
        except OSError as e:
            raise from_os_error(e, path) from e
        self._close = weakref.finalize(self, os.close, self.fd)

    def stat(self, name: str) -> os.stat_result | None:
        """``stat`` of ``name`` in the directory (symlinks followed), ``None`` if absent."""
        try:
            return os.stat(name, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP):
                return None
            raise from_os_error(e, self.path / name) from e

    def is_file(self, name: str) -> bool:
        st = self.stat(name)
        return st is not None and stat.S_ISREG(st.st_mode)

    def read_bytes(self, name: str) -> bytes:
        """The contents of regular file ``name``; anything else is refused without blocking."""
        where = self.path / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            raise from_os_error(e, where) from e
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{where}: [not-regular-file] not a regular file")
            try:
                return f.read()
            except OSError as e:
                raise from_os_error(e, where) from e

    def replaced(self) -> bool:
        """Whether the directory's path now names another directory (or nothing)."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        mine = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino)


class _Replaced(Exception):
    """The directory was replaced while it was being read: start over (carries the error)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


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
    #: the open directory the files are resolved in (``None``: a single file given by path)
    handle: DirHandle | None = field(default=None, compare=False, repr=False)
    #: what :func:`resolve` was given, to start over if the directory is replaced while opening
    requested: tuple[Path, bool] | None = field(default=None, compare=False, repr=False)


def resolve(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> CheckpointFiles:
    """Finds the checkpoint file(s) at ``path`` without opening them.

    Safetensors files are preferred; pickle files (``.bin``/``.pt``..., a directory holding
    ``pytorch_model.bin`` or ``pytorch_model.bin.index.json``) are taken only with
    ``allow_pickle``. Raises ``FileNotFoundError`` (a ``FastloadIOError``) if ``path`` does not
    exist, ``PickleRefusedError`` for a pickle checkpoint that is not allowed, and
    ``CheckpointError`` for a directory with no checkpoint, a broken index, or a path that is not
    a regular file or a directory (a FIFO, a device).
    """
    p = Path(os.fspath(path))
    for attempt in range(ATTEMPTS):
        try:
            return _resolve_once(p, allow_pickle)
        except _Replaced as e:
            if attempt + 1 == ATTEMPTS:
                raise e.error from None
    raise AssertionError("unreachable")  # pragma: no cover


def is_index_name(name: str) -> bool:
    """Whether the file ``name`` names is a sharded checkpoint's index: ``*.index.json``, or a
    variant's index named with the variant before the last suffix
    (``model.safetensors.index.fp16.json``)."""
    return name.endswith(".index.json") or bool(_VARIANT_INDEX.search(name))


_VARIANT_INDEX = re.compile(r"\.index\.[^./\\]+\.json$")


def _resolve_once(p: Path, allow_pickle: bool) -> CheckpointFiles:
    try:
        st = os.stat(p)
    except OSError as e:
        raise from_os_error(e, p) from None
    requested = (p, allow_pickle)
    if stat.S_ISREG(st.st_mode):
        if is_index_name(p.name):
            handle = DirHandle(p.parent)
            name = p.name
            return _in_handle(handle, lambda: _resolve_index(handle, name, allow_pickle, requested))
        if is_pickle(p) and not allow_pickle:
            raise PickleRefusedError(
                f"{p}: a pickle checkpoint, which could run code when loaded; {_PICKLE_ADVICE}"
            )
        return CheckpointFiles(directory=p.parent, files=(p,), requested=requested)
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(
            f"{p}: [not-regular-file] neither a regular file nor a directory (a FIFO, socket or "
            "device); a checkpoint is a .safetensors file or a directory"
        )
    handle = DirHandle(p)
    return _in_handle(handle, lambda: _resolve_dir(handle, allow_pickle, requested))


def _in_handle(handle: DirHandle, resolve_in: Any) -> CheckpointFiles:
    """``resolve_in()``, with an error turned into :class:`_Replaced` if the directory was
    replaced meanwhile (its files may have been deleted under us: start over)."""
    try:
        return resolve_in()
    except (CheckpointError, FastloadIOError) as e:
        if handle.replaced():
            raise _Replaced(e) from e
        raise


def _resolve_dir(
    handle: DirHandle, allow_pickle: bool, requested: tuple[Path, bool]
) -> CheckpointFiles:
    p = handle.path
    if handle.is_file(SINGLE_FILE):
        return CheckpointFiles(
            directory=p, files=(p / SINGLE_FILE,), handle=handle, requested=requested
        )
    if handle.is_file(INDEX_FILE):
        return _resolve_index(handle, INDEX_FILE, allow_pickle, requested)
    for name in _PICKLE_FILES:
        if handle.is_file(name):
            if not allow_pickle:
                raise PickleRefusedError(
                    f"{p}: holds a pickle checkpoint ({name}) and no {SINGLE_FILE} or "
                    f"{INDEX_FILE}; {_PICKLE_ADVICE}"
                )
            if name.endswith(".index.json"):
                return _resolve_index(handle, name, allow_pickle, requested)
            return CheckpointFiles(
                directory=p, files=(p / name,), handle=handle, requested=requested
            )
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


def _check_shard_name(index: Path | str, shard: object) -> str:
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
    if normal == ".":  # the directory itself ("", ".", "sub/.."): no file there
        raise CheckpointError(f"{index}: shard name {shard!r} is not a file name")
    return normal


def parse_index(
    data: bytes, index: Path | str, allow_pickle: bool
) -> tuple[dict[str, str], list[str], dict[str, Any] | None]:
    """A sharded index's ``(weight_map, shard names in first-listed order, metadata)``, checked
    strictly: UTF-8 JSON, a ``weight_map`` object, no tensor listed twice, every shard name
    inside the checkpoint directory (normalized), no pickle shard unless allowed. ``index``
    names the index in messages (a path, or a URL in object storage)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{index}: not UTF-8 text ({e.reason})") from e
    try:
        parsed = json_text.loads(text, index, object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as e:
        raise CheckpointError(
            f"{index}: tensor {e.key!r} is listed twice, in shards {e.first!r} and {e.second!r} "
            "[duplicate-tensor]"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from e
    if not isinstance(parsed, dict) or not isinstance(parsed.get("weight_map"), dict):
        raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to shards")
    weight_map: dict[str, str] = parsed["weight_map"]
    # Shard names normalized ("sub/../x" is "x"), so one file is one shard however it is spelled.
    weight_map = {k: _check_shard_name(index, v) for k, v in weight_map.items()}
    shards = list(dict.fromkeys(weight_map.values()))
    pickled = [name for name in shards if is_pickle(name)]
    if pickled and not allow_pickle:
        raise PickleRefusedError(
            f"{index}: lists pickle shards ({pickled[0]!r}...), which could run code when "
            f"loaded; {_PICKLE_ADVICE}"
        )
    metadata = parsed.get("metadata")
    return weight_map, shards, metadata if isinstance(metadata, dict) else None


def _resolve_index(
    handle: DirHandle, name: str, allow_pickle: bool, requested: tuple[Path, bool]
) -> CheckpointFiles:
    index = handle.path / name
    weight_map, shards, metadata = parse_index(handle.read_bytes(name), index, allow_pickle)
    directory = handle.path
    files = []
    for shard in shards:
        f = directory / shard
        if not handle.is_file(shard):
            raise CheckpointError(
                f"{index}: shard {shard!r} is missing (looked for {f}) [missing-shard]"
            )
        files.append(f)
    return CheckpointFiles(
        directory=directory,
        files=tuple(files),
        index=index,
        weight_map=dict(weight_map),
        index_metadata=metadata,
        handle=handle,
        requested=requested,
    )
