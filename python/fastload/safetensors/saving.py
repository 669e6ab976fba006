"""Writing safetensors files and transformers-layout checkpoints: save_file, save_pretrained.

Tensor bytes are written by the Rust writer (:func:`fastload._core.write_file`): positioned writes
from several threads straight from tensor memory, then fsync. It only ever creates a new file.
``save_file`` writes it under a temporary name and renames it into place; ``save_pretrained``
builds the whole checkpoint in a hidden staging directory and swaps it in whole, so that several
shards are replaced together. How files and directories are put in place crash-safely
(temporary names, fsync, ``renameat2(RENAME_EXCHANGE)``, the file-by-file fallback, the
ownership of temporary files) is :mod:`fastload.safetensors.publish`. An interrupted save leaves
the previous files, not a torn or mixed checkpoint. What a file is written from (the tensors
checked and laid out, the digests) is :mod:`fastload.safetensors.preparing`; what of a model a
checkpoint holds (ties, shards, config files) is :mod:`fastload.safetensors.pretrained_layout`.

``save_pretrained`` is the mirror of loading: each tie group is stored once under its canonical
name (the one transformers keeps), the other names recorded under the ``fastload.tied`` metadata
key so a plain load can re-tie them; shards and ``model.safetensors.index.json`` follow the
transformers layout; transformers models get their config written by the config's own save, minus
the runtime-only ``gradient_checkpointing`` key (transformers #13657).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload import _core
from fastload.core.basics.arguments import check_bool
from fastload.core.basics.errors import FastloadError, RequestError, from_os_error
from fastload.core.basics.threads import check_threads
from fastload.core.basics.units import parse_bytes
from fastload.core.checkpoint.files import INDEX_FILE as INDEX_NAME
from fastload.core.checkpoint.files import SINGLE_FILE as WEIGHTS_NAME
from fastload.core.model.keys import TIED_KEY
from fastload.families import is_transformers_model
from fastload.safetensors import publish
from fastload.safetensors.preparing import _check_metadata, _prepare, _Prepared, _with_digests
from fastload.safetensors.pretrained_layout import (
    _split,
    _stage_config,
    _unwrap_parallel,
    tied_aliases,
)


def parse_size(size: int | str) -> int:
    """Bytes in ``max_shard_size``: an int, or a string like ``"5GB"``, ``"500MB"`` (powers of
    1000, as in transformers) or ``"2GiB"`` (powers of 1024); positive and at most
    :data:`fastload.core.basics.units.MAX_BYTES` (``RequestError`` naming ``max_shard_size``
    otherwise)."""
    return parse_bytes(size, where="max_shard_size", positive=True)


# --- single files -------------------------------------------------------------------------------


def _write_new(
    path: Path, prepared: list[_Prepared], metadata: dict[str, str] | None, threads: int | None
) -> int:
    """Writes ``prepared`` to a new file at ``path`` (fsynced), removing it again on failure."""
    specs = [
        (name, st, shape, t.data_ptr(), t.numel() * t.element_size())
        for name, st, shape, t in prepared
    ]
    try:
        # `prepared` holds the tensors, so every pointer stays valid during the call.
        return _core.write_file(os.fspath(path), specs, metadata, threads)
    except BaseException:
        publish.remove_quietly(path)
        raise


def _naming(exc: FastloadError, tmp: Path, final: Path) -> FastloadError:
    """``exc``, raised about the hidden temporary file, re-worded to name ``final``: the caller
    never asked for the temporary name."""
    err = type(exc)(str(exc).replace(os.fspath(tmp), os.fspath(final)))
    if isinstance(exc, OSError) and isinstance(err, OSError):
        err.errno, err.strerror, err.filename = exc.errno, exc.strerror, os.fspath(final)
    return err


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    digests: bool = False,
) -> None:
    """Saves ``tensors`` to a safetensors file, like ``safetensors.torch.save_file``.

    ``digests=True`` also records a digest of each tensor's bytes in the metadata (key
    ``fastload.digests``), which lets :func:`fastload.reload` skip the tensors that did not
    change; without it the file is byte for byte what safetensors writes.

    Differences: the bytes are written from Rust with several threads (``threads``, default: the
    copy engine's), the file is written under a temporary name, fsynced and renamed over ``path``
    (an interrupted save leaves the old file), and non-contiguous or non-CPU tensors are packed
    instead of refused. Tensors that share memory are refused as safetensors does.

    Raises:
        RequestError: a non-dict, a non-tensor value, a sparse or nested tensor, a tensor named
            ``__metadata__``, non-str metadata (each a ``ValueError``, as in safetensors).
        TensorRefusedError: tensors sharing memory, a meta tensor (each a ``RuntimeError``, as in
            safetensors).
        UnsupportedError: a dtype safetensors cannot store.
        FastloadIOError: the file cannot be written (``PermissionError`` ... with ``errno``).
    """
    path = Path(os.fspath(path))
    where = os.fspath(path)
    check_threads(threads, where)
    meta = _check_metadata(metadata, where)
    check_bool(digests, "digests", where=where)
    prepared = _prepare(tensors, where)
    if digests:
        meta = _with_digests(meta, prepared, where, threads)
    directory = path.parent if str(path.parent) else Path(".")
    # Temporary files of killed saves (their lock is free) go now; live saves' stay.
    publish.remove_stale_temp_files(directory)
    tmp = publish.temp_path(directory, path.name)
    lock = publish.own_temp(tmp, path)
    try:
        try:
            _write_new(tmp, prepared, meta, threads)
        except FastloadError as exc:
            raise _naming(exc, tmp, path) from exc
        publish.replace_file(tmp, path)
    finally:
        lock.release()
    publish.fsync_dir(directory)


# --- checkpoints ----------------------------------------------------------------------------------


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    threads: int | None = None,
    digests: bool = False,
) -> None:
    """Saves ``model`` to ``directory`` in the transformers layout (see :func:`_save_pretrained`).

    ``digests=True`` records a digest of each tensor in its file's metadata (see
    :func:`save_file`), for :func:`fastload.reload` to skip unchanged tensors.

    Raises ``TypeError`` when ``model`` is not an ``nn.Module``; an operating-system error (a
    read-only directory ...) is a :class:`FastloadIOError` that is also the matching built-in
    (``PermissionError`` ...), naming the path.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained needs an nn.Module, got {type(model).__name__}")
    try:
        _save_pretrained(
            model,
            directory,
            max_shard_size=max_shard_size,
            metadata=metadata,
            threads=threads,
            digests=digests,
        )
    except FastloadError:
        raise
    except OSError as exc:
        raise from_os_error(exc, directory, "cannot save the checkpoint") from exc


def _save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    threads: int | None = None,
    digests: bool = False,
) -> None:
    """Saves ``model`` to ``directory`` in the transformers layout.

    - ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` of at most
      ``max_shard_size`` (bytes, or ``"5GB"``/``"500MB"``/``"2GiB"``; a larger tensor gets a shard
      of its own) with ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).
    - Every file's metadata is ``metadata`` plus ``{"format": "pt"}``; tied parameters are stored
      once under the canonical name and, if there are any, ``"fastload.tied"`` holds the JSON
      object ``{alias: canonical}`` (also in the index's metadata).
    - For a transformers model, ``config.json`` (and ``generation_config.json`` for generative
      models) through the config's own save, never with a ``gradient_checkpointing`` key.

    Crash safety: the whole new checkpoint is written and fsynced in a hidden sibling directory
    (``.fastload-<name>.<pid>-<random>.tmp``), the other files of ``directory`` (tokenizer,
    README, sub-directories) are hard-linked into it (copied where linking fails), and the two
    directories are exchanged in one atomic ``renameat2(RENAME_EXCHANGE)``; the old tree is then
    deleted. Killed at any point, the directory holds either the complete old checkpoint or the
    complete new one; a killed save's hidden directory is never read by a load and is removed by
    the next save to the same directory. Weight files of an earlier save that the new one does
    not write (stale shards, a single file replaced by shards) disappear in the same step.

    Where the exchange is unavailable (not Linux, a C library or kernel without it, a filesystem
    that refuses it, ``directory`` a mount point or in an unwritable parent), files are renamed
    into ``directory`` one by one, the index last, and a warning says that a crash inside those
    renames can leave a mix of old and new shards.

    ``directory`` given as a symbolic link saves into the directory it points to. Files added to
    ``directory`` by someone else while the save runs may be lost.

    A ``DistributedDataParallel``/``DataParallel`` wrapper is unwrapped first.
    """
    model = _unwrap_parallel(model)
    limit = parse_size(max_shard_size)
    directory = Path(os.fspath(directory))
    if directory.exists() and not directory.is_dir():
        raise RequestError(f"{directory}: save_pretrained needs a directory, this is a file")
    user_meta = _check_metadata(metadata, os.fspath(directory)) or {}
    check_bool(digests, "digests", where=os.fspath(directory))
    check_threads(threads, os.fspath(directory))
    is_transformers = is_transformers_model(model)

    state = model.state_dict()
    for key in (getattr(model, "_keys_to_ignore_on_save", None) or ()) if is_transformers else ():
        state.pop(key, None)
    aliases = tied_aliases(model, set(state))
    for alias in aliases:
        del state[alias]

    file_meta = {**user_meta, "format": "pt"}
    if aliases:
        file_meta[TIED_KEY] = json.dumps(aliases, sort_keys=True)
    shards, total_size = _split(state, limit)
    sharded = len(shards) > 1
    if sharded:
        count = len(shards)
        names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    else:
        names = [WEIGHTS_NAME]

    target = Path(os.path.realpath(directory))  # a symlink's own directory, not the link
    publish.remove_stale_staging(target)
    staging, swap = publish.make_staging(target)
    try:
        # In publishing order: config files, shards, the index last.
        written = _stage_config(model, staging) if is_transformers else []
        for name in written:
            publish.fsync_file(staging / name)
        for name, keys in zip(names, shards, strict=True):
            # One shard at a time on the CPU: tensors on an accelerator are copied per shard.
            prepared = _prepare({k: state[k] for k in keys}, os.fspath(directory / name))
            meta = _with_digests(file_meta, prepared, name, threads) if digests else file_meta
            _write_new(staging / name, prepared, meta, threads)
            written.append(name)
            del prepared
        if sharded:
            index_meta: dict[str, Any] = {
                "total_parameters": sum(p.numel() for p in model.parameters()),
                "total_size": total_size,
            }
            if aliases:
                index_meta[TIED_KEY] = aliases
            weight_map = {k: name for name, keys in zip(names, shards, strict=True) for k in keys}
            index = {"metadata": index_meta, "weight_map": weight_map}
            with open(staging / INDEX_NAME, "x", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            written.append(INDEX_NAME)
        publish.fsync_dir(staging)
        if not (swap and publish.swap_into_place(staging, target, set(written))):
            publish.publish_file_by_file(staging, target, written, sharded)
    finally:
        # After a swap this is the previous checkpoint; otherwise what is left of the new one.
        publish.drop_staging(staging)


__all__ = ["save_file", "save_pretrained", "parse_size", "TIED_KEY"]
