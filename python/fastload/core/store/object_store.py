"""Checkpoints in object storage, as sources of the same load as local files.

``s3://bucket/key`` (and ``s3a://``), ``gs://bucket/key``, ``az://container/key`` (and
``azure://``, ``abfs(s)://``, ``adl://``) and ``http(s)://host/path`` URLs open through the Rust
core's object store source (:class:`fastload._core.ObjectStore`, the ``object_store`` crate): a
file's 8-byte header length and header are read and validated strictly before anything else is
allocated, then a copy reads exactly the byte ranges its destinations need, with parallel ranged
GETs written straight into the destination tensors (no temporary file, no whole-object buffer).
The files come back as ``fastload._core.SafetensorsFile`` objects (``mode == "ranged-get"``), so
``safe_open``, ``load_file`` and ``from_pretrained`` read them as they read local ones.

A checkpoint URL names one ``.safetensors`` object, a sharded index (``*.index.json``), or a
prefix ("directory") holding ``model.safetensors`` or ``model.safetensors.index.json``. An index
is checked as a local one (:func:`fastload.core.checkpoint.files.parse_index`); its shards' headers
are read in parallel, and their tensors are read in parallel across shards.

Failures: a missing object or bucket is ``FileNotFoundError`` (a ``FastloadIOError``), denied
access ``PermissionError``, a store that cannot be reached or keeps failing after the retries
``FastloadIOError``, an object replaced during the load or a malformed header
``CheckpointError``, a configuration the client cannot use ``RequestError``; each message names
the URL (and the tensor being read). Configuration: :mod:`fastload.core.store.store_config`.

Not read from object storage: pickle checkpoints (``.bin``/``.pt``), and views of a mapping
(``mmap="shared"``; every tensor is a copy the engine fills).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fastload import _core
from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    FastloadFileNotFoundError,
    RequestError,
)
from fastload.core.checkpoint import new_files
from fastload.core.checkpoint.files import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointFiles,
    is_index_name,
    parse_index,
)
from fastload.core.checkpoint.opened import OpenCheckpoint, build_table
from fastload.core.checkpoint.pickle_file import is_pickle
from fastload.core.checkpoint.side_files import DEFAULT_PATTERNS, WEIGHT_PATTERNS
from fastload.core.store.store_config import aws_profile_defaults, check_storage_options

#: URL schemes read from object storage (as ``object_store`` recognizes them)
SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https")
#: the largest index or side file (config, tokenizer) read whole
MAX_SMALL_FILE = 64 << 20


def is_url(path: object) -> bool:
    """Whether ``path`` is an object storage URL fastload reads (``s3://...`` ...)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0].lower() in SCHEMES


def is_remote(file: object) -> bool:
    """Whether an opened checkpoint file (a ``_core.SafetensorsFile``, a pickle file...) is an
    object in object storage."""
    return isinstance(file, _core.SafetensorsFile) and file.remote


class ObjectUrl(str):
    """The URL of an object or prefix in object storage, where a checkpoint's location holds a
    local ``Path``: a ``str`` (messages and reports show it whole), with the two operations
    locations use, ``name`` and ``/``. Never a local path."""

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, name: str) -> ObjectUrl:
        return ObjectUrl(f"{self.rstrip('/')}/{name}")


def open_store(
    url: str, storage_options: Mapping[str, object] | None = None, *, where: str = ""
) -> _core.ObjectStore:
    """The store ``url`` is in, and its client (see :mod:`fastload.core.store.store_config`); its
    ``key`` is the part of ``url`` inside it."""
    options = check_storage_options(storage_options, where or url)
    scheme = url.split("://", 1)[0].lower()
    aws = scheme in ("s3", "s3a") or (scheme == "https" and ".amazonaws.com" in url)
    defaults = aws_profile_defaults(options) if aws else None
    return _core.ObjectStore(url, options, defaults)


def open_file(
    url: str, storage_options: Mapping[str, object] | None = None, *, strict: bool = False
) -> _core.SafetensorsFile:
    """One ``.safetensors`` object, its header read and validated (``strict`` as for a local
    file)."""
    store = open_store(url, storage_options)
    _refuse_pickle(url, store.key)
    [file] = store.open([store.key], strict=strict)
    return file


def _refuse_pickle(where: str, key: str) -> None:
    if is_pickle(key):
        raise RequestError(
            f"{where}: a pickle checkpoint in object storage; fastload reads safetensors "
            "checkpoints from object storage only (convert it once with `fastload convert`)"
        )


def resolve(
    url: str, storage_options: Mapping[str, object] | None = None
) -> tuple[_core.ObjectStore, CheckpointFiles, list[str]]:
    """The store of ``url``, the checkpoint it names (a ``.safetensors`` object, an index, or a
    prefix holding ``model.safetensors`` or ``model.safetensors.index.json``), and the keys of
    its files. Nothing but the index (if any) is read; a missing checkpoint is
    ``FileNotFoundError`` naming what was looked for."""
    store = open_store(url, storage_options)
    key = store.key
    found = store.head(key) if key and not url.endswith("/") else None
    if found is not None:
        _refuse_pickle(url, key)
        if is_index_name(key):
            return _resolve_index(store, key, found[0])
        prefix = posixpath.dirname(key)
        location = CheckpointFiles(
            directory=ObjectUrl(store.url_of(prefix)), files=(ObjectUrl(store.url_of(key)),)
        )
        return store, location, [key]
    prefix = key.rstrip("/")
    single = posixpath.join(prefix, SINGLE_FILE) if prefix else SINGLE_FILE
    if store.head(single) is not None:
        location = CheckpointFiles(
            directory=ObjectUrl(store.url_of(prefix)), files=(ObjectUrl(store.url_of(single)),)
        )
        return store, location, [single]
    index = posixpath.join(prefix, INDEX_FILE) if prefix else INDEX_FILE
    found = store.head(index)
    if found is not None:
        return _resolve_index(store, index, found[0])
    raise FastloadFileNotFoundError(
        f"{url}: no checkpoint there: neither an object of that name nor "
        f"{store.url_of(single)} or {store.url_of(index)} exists"
    )


def _resolve_index(
    store: _core.ObjectStore, index_key: str, size: int
) -> tuple[_core.ObjectStore, CheckpointFiles, list[str]]:
    index = ObjectUrl(store.url_of(index_key))
    weight_map, shards, metadata = parse_index(
        _get_small(store, index_key, size), index, allow_pickle=False
    )
    prefix = posixpath.dirname(index_key)
    keys = [posixpath.join(prefix, shard) if prefix else shard for shard in shards]
    location = CheckpointFiles(
        directory=ObjectUrl(store.url_of(prefix)),
        files=tuple(ObjectUrl(store.url_of(k)) for k in keys),
        index=index,
        weight_map=dict(weight_map),
        index_metadata=metadata,
    )
    return store, location, keys


def _get_small(store: _core.ObjectStore, key: str, size: int) -> bytes:
    """The whole of object ``key`` (an index, a config, a tokenizer file), of ``size`` bytes as
    listed or asked: a ``CheckpointError`` naming the limit, unread, beyond
    :data:`MAX_SMALL_FILE` (such a file is read into memory whole)."""
    if size > MAX_SMALL_FILE:
        raise CheckpointError(
            f"{store.url_of(key)}: {size} bytes, more than the {MAX_SMALL_FILE} bytes an index, "
            "config or tokenizer file read from object storage may have [file-too-large]"
        )
    return bytes(store.get(key, MAX_SMALL_FILE))


def open_checkpoint(
    url: str, storage_options: Mapping[str, object] | None = None, *, strict: bool = False
) -> OpenCheckpoint:
    """The checkpoint at ``url`` with every file opened (their headers read in parallel and
    validated) and its table of tensors built, checked against the index as a local one is."""
    store, location, keys = resolve(url, storage_options)
    try:
        files = store.open(keys, strict=strict)
    except FileNotFoundError as e:
        if location.index is None:
            raise
        raise CheckpointError(
            f"{location.index}: a shard it lists is missing (looked for {e.filename}) "
            "[missing-shard]"
        ) from e
    except RequestError as e:
        # The store read the index with this configuration: what it cannot use now is a shard
        # name the index gave, a fault of the checkpoint as it would be of a local one.
        if location.index is None:
            raise
        raise CheckpointError(f"{location.index}: a shard name it lists is not usable ({e})") from e
    # each file's name in the index: its key below the index's prefix
    names = list(location.weight_map.values()) if location.weight_map is not None else []
    names = list(dict.fromkeys(names)) or [posixpath.basename(k) for k in keys]
    return build_table(location, list(files), names)


def read_into(store: _core.ObjectStore, key: str, offset: int, out: torch.Tensor) -> int:
    """Fills the contiguous CPU tensor ``out`` with the bytes of object ``key`` at ``offset``:
    one ranged GET straight into it, with no validation (the raw transport: what a load is
    measured against). Returns the bytes read."""
    if out.device.type != "cpu" or not out.is_contiguous():
        raise RequestError(f"{store.url_of(key)}: read_into needs a contiguous CPU tensor")
    return store._read_into(key, offset, out.data_ptr(), out.numel() * out.element_size())


def fetch_files(
    url: str,
    names: Sequence[str],
    destination: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, object] | None = None,
) -> list[Path]:
    """Copies the objects ``names`` under the prefix ``url`` that exist (``config.json``,
    ``generation_config.json`` ...) into the local directory ``destination``, by name, without
    listing the prefix (read-only buckets often refuse listing). Each is at most
    :data:`MAX_SMALL_FILE` bytes. Returns the files written (all of them, or none: see
    :func:`_write_all`)."""
    store = open_store(url, storage_options)
    prefix = store.key.rstrip("/")
    keys = [(name, posixpath.join(prefix, name) if prefix else name) for name in names]
    found = [(name, key, store.head(key)) for name, key in keys]
    return _write_all(store, destination, [(n, k, f[0]) for n, k, f in found if f is not None])


def _write_all(
    store: _core.ObjectStore,
    destination: str | os.PathLike[str],
    items: list[tuple[str, str, int]],
) -> list[Path]:
    """Objects ``items`` (name, key, size) as ``destination / name``: each read whole
    (:func:`_get_small`) and written to a
    new temporary (:mod:`fastload.core.checkpoint.new_files`: never through a link, a short name
    whatever the final one's length), then renamed into place once every one is written, so a
    failure leaves no file of this fetch behind. The temporaries an earlier fetch into
    ``destination`` left when it was killed are removed first
    (:func:`fastload.core.checkpoint.new_files.sweep`)."""
    dest = Path(os.fspath(destination))
    dest.mkdir(parents=True, exist_ok=True)
    new_files.sweep(dest)
    staged: list[tuple[Path, Path]] = []
    try:
        for name, key, size in items:
            data = _get_small(store, key, size)
            staged.append((new_files.write_temporary(dest, data), dest / name))
    except BaseException:
        new_files.discard(tmp for tmp, _ in staged)
        raise
    return [new_files.publish(tmp, target) for tmp, target in staged]


def download_files(
    url: str,
    destination: str | os.PathLike[str],
    *,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    ignore: Sequence[str] = WEIGHT_PATTERNS,
    storage_options: Mapping[str, object] | None = None,
) -> list[Path]:
    """Copies the small files directly under the prefix ``url`` whose names match ``patterns``
    (and none of ``ignore``: by default every weight format, :data:`WEIGHT_PATTERNS`) into the
    local directory ``destination``: what a model needs besides its weights (``config.json``,
    ``generation_config.json``, tokenizer files). Each is at most :data:`MAX_SMALL_FILE` bytes;
    all are written, or none (:func:`_write_all`). Returns the files written."""
    store = open_store(url, storage_options)
    prefix = store.key.rstrip("/")
    items = []
    for key, size in _listing(store, url, prefix):
        name = posixpath.basename(key)
        wanted = any(fnmatch.fnmatch(name, p) for p in patterns)
        if not wanted or _ignored(name, ignore) or name in ("", ".", ".."):
            continue
        items.append((name, key, size))
    return _write_all(store, destination, items)


def _listing(store: _core.ObjectStore, url: str, prefix: str) -> list[tuple[str, int]]:
    """``store.list(prefix)``; an HTTP server that cannot list (an HTTP listing is a WebDAV
    ``PROPFIND``, which plain web servers refuse) is a ``RequestError`` saying what to do, not
    the server's answer."""
    try:
        return list(store.list(prefix))
    except FastloadError as e:
        refused = any(f"status code: {code}" in str(e) for code in (400, 405, 501))
        if url.split("://", 1)[0].lower() not in ("http", "https") or "PROPFIND" not in str(e):
            raise
        if not refused:
            raise
        raise RequestError(
            f"{url}: this HTTP server does not list its files (a listing over HTTP is a WebDAV "
            "PROPFIND request, which it refused), and fetching by pattern needs one: serve "
            "the prefix from a store that lists (s3://, gs://, az://, a WebDAV server), or "
            "copy the files by name"
        ) from None


def _ignored(name: str, ignore: Sequence[str]) -> bool:
    """Whether ``name`` matches one of ``ignore``, in any letter case (``MODEL.GGUF``)."""
    return any(fnmatch.fnmatchcase(name.lower(), p.lower()) for p in ignore)


__all__ = [
    "DEFAULT_PATTERNS",
    "ObjectUrl",
    "SCHEMES",
    "WEIGHT_PATTERNS",
    "download_files",
    "fetch_files",
    "is_remote",
    "is_url",
    "open_checkpoint",
    "open_file",
    "open_store",
    "read_into",
    "resolve",
]
