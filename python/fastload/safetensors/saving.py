"""Writing safetensors files and transformers-layout checkpoints: save_file, save_pretrained.

Tensor bytes are written by the Rust writer (:func:`fastload._core.write_file`): positioned writes
from several threads straight from tensor memory, then fsync. It only ever creates a new file.
``save_file`` writes it under a temporary name and renames it into place; ``save_pretrained``
builds the whole checkpoint in a hidden staging directory and swaps it in whole, so that several
shards are replaced together. How files and directories are put in place crash-safely
(temporary names, fsync, ``renameat2(RENAME_EXCHANGE)``, the file-by-file fallback, the
ownership of temporary files) is :mod:`fastload.safetensors.publish`. An interrupted save leaves
the previous files, not a torn or mixed checkpoint.

``save_pretrained`` is the mirror of loading: each tie group is stored once under its canonical
name (the one transformers keeps), the other names recorded under the ``fastload.tied`` metadata
key so a plain load can re-tie them; shards and ``model.safetensors.index.json`` follow the
transformers layout; transformers models get their config written by the config's own save, minus
the runtime-only ``gradient_checkpointing`` key (transformers #13657).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload import _core
from fastload.core.arguments import check_bool
from fastload.core.checkpoint import INDEX_FILE as INDEX_NAME
from fastload.core.checkpoint import SINGLE_FILE as WEIGHTS_NAME
from fastload.core.digests import DIGESTS_KEY, digest_metadata
from fastload.core.dtypes import st_shape, to_st
from fastload.core.errors import FastloadError, RequestError, TensorRefusedError, from_os_error
from fastload.core.keys import TIED_KEY
from fastload.core.threads import check_threads
from fastload.core.tying import find_tie_groups
from fastload.core.units import parse_bytes
from fastload.families import is_transformers_model
from fastload.safetensors import publish
from fastload.training.gradient_checkpointing import LEGACY_CONFIG_KEY, drop_legacy_config_key

# safetensors' Dtype enum order; files are laid out by decreasing dtype like its writer does, so
# every tensor's data stays aligned to its element size.
_DTYPE_ORDER = [
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64",
    "I64", "U64",
]  # fmt: skip
_DTYPE_RANK = {name: i for i, name in enumerate(_DTYPE_ORDER)}

# (name, safetensors dtype, shape, CPU contiguous tensor that owns the bytes)
_Prepared = tuple[str, str, list[int], torch.Tensor]


def parse_size(size: int | str) -> int:
    """Bytes in ``max_shard_size``: an int, or a string like ``"5GB"``, ``"500MB"`` (powers of
    1000, as in transformers) or ``"2GiB"`` (powers of 1024); positive and at most
    :data:`fastload.core.units.MAX_BYTES` (``RequestError`` naming ``max_shard_size`` otherwise)."""
    return parse_bytes(size, where="max_shard_size", positive=True)


# --- single files -------------------------------------------------------------------------------


def _check_metadata(metadata: Mapping[str, str] | None, where: str) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise RequestError(f"{where}: metadata must be a dict of str to str, got {type(metadata)}")
    bad = [k for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise RequestError(f"{where}: metadata keys and values must be str; not so for {bad!r}")
    return dict(metadata)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) that ``t`` touches in its storage."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _refuse_shared(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Tensors whose memory overlaps would be written twice and load as two independent tensors,
    silently breaking a tie; refuse them like safetensors does."""
    by_storage: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        start, end = byte_span(t)
        key = (str(t.device), t.untyped_storage().data_ptr())
        by_storage.setdefault(key, []).append((start, end, name))
    for spans in by_storage.values():
        spans.sort()
        for (_, prev_end, prev), (start, _, name) in zip(spans, spans[1:], strict=False):
            if start < prev_end:
                raise TensorRefusedError(
                    f"{where}: tensors {prev!r} and {name!r} share memory; a file stores each "
                    "tensor's bytes separately, so the tie would be lost. Save one of them (or "
                    "use fastload.save_pretrained, which records ties), or .clone() the other"
                )


def _prepare(tensors: Mapping[str, torch.Tensor], where: str) -> list[_Prepared]:
    """Validates the tensors and returns CPU contiguous versions, in the file's layout order.

    The refusals use safetensors' exception classes (and, for a wrong argument, its words):
    ``ValueError`` for a non-dict, a non-tensor or a sparse tensor, ``RuntimeError`` for shared
    memory or a meta tensor, each also a ``fastload.FastloadError``.
    """
    if not isinstance(tensors, Mapping):
        raise RequestError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise RequestError(f"{where}: tensor names must be str, got {name!r}")
        if name == "__metadata__":
            raise RequestError(
                f"{where}: a tensor cannot be named '__metadata__': the format reserves that key "
                "for the metadata (pass metadata={...} instead)"
            )
        if not isinstance(t, torch.Tensor):
            raise RequestError(
                f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)}"
            )
        if t.is_nested:
            raise RequestError(
                f"{where}: tensor {name!r} is a nested tensor, which a safetensors file cannot "
                "hold; save its components, or .to_padded_tensor(0.0)"
            )
        if t.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise RequestError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            "support. You can make it a dense tensor before saving with `.to_dense()` but be "
            "aware this might make a much larger file than needed."
        )
    for name, t in tensors.items():
        if t.device.type == "meta":
            raise TensorRefusedError(
                f"{where}: tensor {name!r} is on the meta device: Cannot copy out of meta tensor; "
                "no data!"
            )
    _refuse_shared(tensors, where)
    out: list[_Prepared] = []
    for name, t in tensors.items():
        st = to_st(t.dtype)
        # resolve_conj/neg: lazy conjugate/negative views hold un-applied bytes.
        data = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
        out.append((name, st, st_shape(t.dtype, t.shape, where=where), data))
    out.sort(key=lambda p: (-_DTYPE_RANK.get(p[1], -1), p[0]))
    return out


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


def _with_digests(
    meta: dict[str, str] | None, prepared: list[_Prepared], where: str, threads: int | None
) -> dict[str, str]:
    """``meta`` plus the digest of every prepared tensor (:mod:`fastload.core.digests`)."""
    meta = dict(meta or {})
    if DIGESTS_KEY in meta:
        raise RequestError(
            f"{where}: metadata already has the key {DIGESTS_KEY!r}, which digests=True writes; "
            "drop one of them"
        )
    meta[DIGESTS_KEY] = digest_metadata([(name, t) for name, _, _, t in prepared], threads)
    return meta


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


def _unwrap_parallel(model: nn.Module) -> nn.Module:
    # DistributedDataParallel/DataParallel would prefix every name with "module.".
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def _tie_target_patterns(model: nn.Module) -> list[str]:
    """The names transformers derives from another one (``_tied_weights_keys``; dict keys in
    transformers 5, a list in 4); transformers drops these on save and keeps the source."""
    patterns: list[str] = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        keys = tied.keys() if isinstance(tied, Mapping) else tied
        patterns.extend(f"{prefix}.{k}" if prefix else k for k in keys)
    return patterns


def tied_aliases(model: nn.Module, names: set[str] | None = None) -> dict[str, str]:
    """``{alias: canonical}`` for every tie group of ``model``: the canonical name is the one a
    checkpoint stores (for transformers models the one transformers keeps, otherwise the first
    in ``named_parameters`` order); each alias is the same Parameter under another name.

    ``names``, if given, restricts the groups to those names (a state dict's keys).
    """
    targets = _tie_target_patterns(model) if is_transformers_model(model) else []
    aliases: dict[str, str] = {}
    for group in find_tie_groups(model):
        present = [n for n in group if names is None or n in names]
        if len(present) < 2:
            continue
        sources = [n for n in present if not any(re.search(p, n) for p in targets)]
        canonical = sources[0] if sources else present[0]
        aliases.update({n: canonical for n in present if n != canonical})
    return aliases


def _split(state: Mapping[str, torch.Tensor], limit: int) -> tuple[list[list[str]], int]:
    """Shards in state-dict order, the way huggingface_hub splits: a tensor over the limit gets a
    shard of its own, otherwise a new shard starts when the next tensor would tip it over."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for name, t in state.items():
        size = t.numel() * t.element_size()
        total += size
        if size > limit:
            shards.append([name])
            continue
        if current and current_size + size > limit:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards, total


def _stage_config(model: nn.Module, staging: Path) -> list[str]:
    """Writes the model's config (and generation config) with their own save into ``staging``;
    returns the file names written."""
    config: Any = copy.deepcopy(model.config)  # a transformers PretrainedConfig
    # Runtime state only (transformers #13657): a legacy key must not be written back.
    drop_legacy_config_key(config)
    config.architectures = [type(model).__name__]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(staging)
    config_file = staging / "config.json"
    if config_file.is_file():
        # Belt and braces for configs whose to_dict re-adds the key from elsewhere.
        data = json.loads(config_file.read_text(encoding="utf-8"))
        if data.pop(LEGACY_CONFIG_KEY, None) is not None:
            config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", "utf-8")
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(staging)
    return sorted(p.name for p in staging.iterdir() if p.is_file())


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


__all__ = ["save_file", "save_pretrained", "parse_size", "tied_aliases", "TIED_KEY"]
