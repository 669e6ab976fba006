"""Writing safetensors files and transformers-layout checkpoints: save_file, save_pretrained.

Tensor bytes are written by the Rust writer (:func:`fastload._core.write_file`): positioned writes
from several threads straight from tensor memory, then fsync. It only ever creates a new file.
``save_file`` gives the file a temporary name in its final directory (never ending in
``.safetensors``, so no loader picks up a half-written one), fsyncs it, renames it into place and
fsyncs the directory. ``save_pretrained`` builds the whole checkpoint in a hidden sibling directory
and exchanges it with the old one in a single ``renameat2(RENAME_EXCHANGE)``, so that several
shards are replaced together. An interrupted save leaves the previous files, not a torn or mixed
checkpoint.

``save_pretrained`` is the mirror of loading: each tie group is stored once under its canonical
name (the one transformers keeps), the other names recorded under the ``fastload.tied`` metadata
key so a plain load can re-tie them; shards and ``model.safetensors.index.json`` follow the
transformers layout; transformers models get their config written by the config's own save, minus
the runtime-only ``gradient_checkpointing`` key (transformers #13657).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload import _core, ownership
from fastload.checkpoint import INDEX_FILE as INDEX_NAME
from fastload.checkpoint import SINGLE_FILE as WEIGHTS_NAME
from fastload.dtypes import st_shape, to_st
from fastload.errors import (
    FastloadError,
    FastloadIOError,
    RequestError,
    TensorRefusedError,
    from_os_error,
)
from fastload.skeleton import is_transformers_model
from fastload.threads import check_threads
from fastload.tying import find_tie_groups
from fastload.units import parse_bytes

logger = logging.getLogger("fastload")

TIED_KEY = "fastload.tied"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
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
    1000, as in transformers) or ``"2GiB"`` (powers of 1024)."""
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


def _temp_path(directory: Path, final_name: str) -> Path:
    # Hidden, and ending in .tmp: a loader globbing *.safetensors never sees it.
    return directory / f".{final_name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _fsync_dir(directory: Path) -> None:
    """Makes the renames in ``directory`` durable (a rename is a directory write)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories have nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _own(item: Path, final: Path) -> ownership.OwnerLock:
    """The lock that marks ``item``, a temporary file of the save to ``final``, as this save's
    (see :mod:`fastload.ownership`); errors name ``final``."""
    try:
        return ownership.OwnerLock(item)
    except OSError as e:
        raise from_os_error(e, final) from e


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


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
        _remove_quietly(path)
        raise


def _replace(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
    except OSError as exc:
        _remove_quietly(tmp)
        raise from_os_error(exc, final, "cannot move the written file into place") from exc


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
) -> None:
    """Saves ``tensors`` to a safetensors file, like ``safetensors.torch.save_file``.

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
    prepared = _prepare(tensors, where)
    directory = path.parent if str(path.parent) else Path(".")
    # Temporary files of killed saves (their lock is free) go now; live saves' stay.
    ownership.sweep(directory, _TEMP_FILE_RE)
    tmp = _temp_path(directory, path.name)
    lock = _own(tmp, path)
    try:
        try:
            _write_new(tmp, prepared, meta, threads)
        except FastloadError as exc:
            raise _naming(exc, tmp, path) from exc
        _replace(tmp, path)
    finally:
        lock.release()
    _fsync_dir(directory)


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
    config = copy.deepcopy(model.config)
    # Runtime state only (transformers #13657): a legacy key must not be written back.
    if "gradient_checkpointing" in vars(config):
        delattr(config, "gradient_checkpointing")
    config.architectures = [type(model).__name__]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(staging)
    config_file = staging / "config.json"
    if config_file.is_file():
        # Belt and braces for configs whose to_dict re-adds the key from elsewhere.
        data = json.loads(config_file.read_text(encoding="utf-8"))
        if data.pop("gradient_checkpointing", None) is not None:
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
) -> None:
    """Saves ``model`` to ``directory`` in the transformers layout (see :func:`_save_pretrained`).

    Raises ``TypeError`` when ``model`` is not an ``nn.Module``; an operating-system error (a
    read-only directory ...) is a :class:`FastloadIOError` that is also the matching built-in
    (``PermissionError`` ...), naming the path.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pretrained needs an nn.Module, got {type(model).__name__}")
    try:
        _save_pretrained(
            model, directory, max_shard_size=max_shard_size, metadata=metadata, threads=threads
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
    _remove_stale_staging(target)
    staging, swap = _make_staging(target)
    try:
        # In publishing order: config files, shards, the index last.
        written = _stage_config(model, staging) if is_transformers else []
        for name in written:
            _fsync_file(staging / name)
        for name, keys in zip(names, shards, strict=True):
            # One shard at a time on the CPU: tensors on an accelerator are copied per shard.
            prepared = _prepare({k: state[k] for k in keys}, os.fspath(directory / name))
            _write_new(staging / name, prepared, file_meta, threads)
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
        _fsync_dir(staging)
        if not (swap and _swap_into_place(staging, target, set(written))):
            _publish_file_by_file(staging, target, written, sharded)
    finally:
        # After a swap this is the previous checkpoint; otherwise what is left of the new one.
        _drop_staging(staging)


# --- publishing a checkpoint directory ------------------------------------------------------------

#: Linux ``renameat2`` flag: exchange the two paths atomically (both must exist).
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# The ownership locks of the staging directories this process is using now.
_STAGING_LOCKS: dict[str, ownership.OwnerLock] = {}
# Temporary names of per-file writes (see _temp_path) left by a killed save.
_TEMP_FILE_RE = re.compile(r"^\.(?P<final>.+)\.\d+-[0-9a-f]{8}\.tmp$")


def _staging_pattern(target_name: str | None) -> re.Pattern[str]:
    """Names of staging directories: ``.fastload-<target name>.<pid>-<hex>.tmp`` beside the
    target, ``.fastload-<pid>-<hex>.tmp`` inside it (the fallback)."""
    middle = re.escape(target_name) + r"\." if target_name is not None else ""
    return re.compile(rf"^\.fastload-{middle}(?P<pid>\d+)-[0-9a-f]{{8}}\.tmp$")


_INNER_STAGING_RE = _staging_pattern(None)


def _is_weight_file(name: str) -> bool:
    return name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(name) is not None


def _remove_stale_staging(target: Path) -> None:
    """Deletes staging directories that killed saves to ``target`` left behind: those whose
    ownership lock is free (:mod:`fastload.ownership`); a running save's are left alone, in this
    or any other process, container or host sharing the filesystem."""
    ownership.sweep(target.parent, _staging_pattern(target.name))
    ownership.sweep(target, _INNER_STAGING_RE)


def _mkdir_staging(place: Path, target_name: str | None) -> Path:
    # The pid in the name only helps a person reading the directory; the lock decides.
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    name = f".fastload-{tag}.tmp" if target_name is None else f".fastload-{target_name}.{tag}.tmp"
    path = place / name
    lock = ownership.OwnerLock(path)
    try:
        os.mkdir(path, 0o777)  # the umask applies, as for any directory the user creates
    except BaseException:
        lock.release()
        raise
    _STAGING_LOCKS[os.fspath(path)] = lock
    return path


def _drop_staging(staging: Path) -> None:
    """Deletes a staging directory of this process, then gives up its lock."""
    shutil.rmtree(staging, ignore_errors=True)
    lock = _STAGING_LOCKS.pop(os.fspath(staging), None)
    if lock is not None:
        lock.release()


def _make_staging(target: Path) -> tuple[Path, bool]:
    """A new, empty, hidden directory to write the checkpoint into, and whether it can replace
    ``target`` whole (a sibling on the same filesystem, where the exchange works)."""
    parent = target.parent
    exists = target.is_dir()
    if not exists:
        parent.mkdir(parents=True, exist_ok=True)
    elif parent == target or os.stat(parent).st_dev != os.stat(target).st_dev:
        # The root, or a mount point (a container volume): it cannot be renamed.
        _warn_file_by_file(target, "it is a mount point")
        return _mkdir_staging(target, None), False
    try:
        staging = _mkdir_staging(parent, target.name)
    except OSError as exc:
        if not exists:
            raise
        _warn_file_by_file(target, f"cannot create a directory beside it: {exc.strerror or exc}")
        return _mkdir_staging(target, None), False
    if not exists:
        return staging, True
    try:
        problem = _exchange_problem(staging)
    except BaseException:
        _drop_staging(staging)
        raise
    if problem is not None:
        _warn_file_by_file(target, problem)
    return staging, problem is None


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2`` (glibc >= 2.28), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> None:
    """Atomically swaps the directory entries ``a`` and ``b`` (both must exist)."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available on this platform")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _exchange_problem(staging: Path) -> str | None:
    """Why two directories of ``staging``'s filesystem cannot be exchanged, or ``None``: tried on
    two empty directories inside it before anything is written."""
    a, b = staging / "a", staging / "b"
    try:
        a.mkdir()
        b.mkdir()
        _exchange(a, b)
    except OSError as exc:
        return f"renameat2(RENAME_EXCHANGE) failed: {exc.strerror or exc}"
    finally:
        for d in (a, b):
            with contextlib.suppress(OSError):
                d.rmdir()
    return None


def _warn_file_by_file(target: Path, reason: str) -> None:
    logger.warning(
        "%s: the checkpoint directory cannot be replaced in one step (%s); its files are renamed "
        "into place one by one, the index last, so a crash during those renames can leave a mix "
        "of old and new shards",
        target,
        reason,
    )


def _link_tree(source: str, dest: str, skip: Callable[[str], bool], device: int) -> None:
    """Recreates the entries of directory ``source`` in ``dest`` (except names ``skip`` accepts):
    files as hard links (copies where linking fails), symlinks as symlinks, directories anew.
    Raises ``OSError`` for anything it cannot reproduce faithfully (a fifo, a socket, a mounted
    filesystem inside), so the caller can publish another way instead of losing it."""
    with os.scandir(source) as it:
        entries = list(it)
    for entry in entries:
        if skip(entry.name):
            continue
        dst = os.path.join(dest, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        elif entry.is_dir(follow_symlinks=False):
            if entry.stat(follow_symlinks=False).st_dev != device:
                raise OSError(errno.EXDEV, "a filesystem is mounted there", entry.path)
            os.mkdir(dst)
            _link_tree(entry.path, dst, lambda _: False, device)
            _copy_metadata(entry.path, dst)
            _fsync_dir(Path(dst))
        elif entry.is_file(follow_symlinks=False):
            try:
                os.link(entry.path, dst, follow_symlinks=False)
            except OSError:  # no hard links here, a link limit, or protected_hardlinks
                shutil.copy2(entry.path, dst, follow_symlinks=False)
                _copy_metadata(entry.path, dst)
                _fsync_file(Path(dst))
        else:
            raise OSError(errno.EOPNOTSUPP, "not a file, directory or symlink", entry.path)


def _copy_metadata(source: str | Path, dest: str | Path) -> None:
    """Mode, times, extended attributes (ACLs) and, where permitted, owner of ``source``."""
    shutil.copystat(source, dest, follow_symlinks=False)
    st = os.stat(source, follow_symlinks=False)
    if hasattr(os, "chown"):
        with contextlib.suppress(OSError):  # only root may give a file away
            os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)


def _swap_into_place(staging: Path, target: Path, written: set[str]) -> bool:
    """Makes ``staging`` the checkpoint directory in one atomic step; returns ``False`` (having
    warned) when it cannot, with ``target`` untouched. Afterwards ``staging`` names the old
    tree."""
    if not target.exists():
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # Created meanwhile: exchange with it like with any existing directory.
        else:
            _fsync_dir(target.parent)
            return True

    def owned(name: str) -> bool:
        # What this save writes, every weight file of earlier saves, leftovers of killed saves
        # and the ownership locks of any save (never carried into the new tree).
        if ownership.PENDING_RE.match(name):
            return True
        if name.endswith(ownership.LOCK_SUFFIX):
            base = name[: -len(ownership.LOCK_SUFFIX)]
            return bool(_INNER_STAGING_RE.match(base) or _TEMP_FILE_RE.match(base))
        temp = _TEMP_FILE_RE.match(name)
        return (
            name in written
            or _is_weight_file(name)
            or _INNER_STAGING_RE.match(name) is not None
            or (temp is not None and (_is_weight_file(temp["final"]) or temp["final"] in written))
        )

    for name in os.listdir(target):
        path = target / name
        if (name in written or _is_weight_file(name)) and path.is_dir() and not path.is_symlink():
            raise FastloadIOError(f"{path}: is a directory; the save would replace it")
    try:
        _link_tree(os.fspath(target), os.fspath(staging), owned, os.stat(target).st_dev)
        _copy_metadata(target, staging)
        os.utime(staging)  # the save is a change of the directory
        _fsync_dir(staging)
    except OSError as exc:
        _warn_file_by_file(target, f"cannot carry over {exc.filename}: {exc.strerror or exc}")
        return False
    cwd = _cwd_within(target)
    try:
        _exchange(staging, target)
    except OSError as exc:
        _warn_file_by_file(target, f"renameat2(RENAME_EXCHANGE) failed: {exc.strerror or exc}")
        return False
    _fsync_dir(target.parent)
    if cwd is not None:
        # This process's working directory was in the old tree, which is about to be deleted.
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    return True


def _cwd_within(target: Path) -> str | None:
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    real = os.path.realpath(cwd)
    inside = real == os.fspath(target) or real.startswith(os.path.join(os.fspath(target), ""))
    return cwd if inside else None


def _publish_file_by_file(staging: Path, target: Path, written: list[str], sharded: bool) -> None:
    """The fallback: each file renamed from ``staging`` into ``target`` in ``written`` order
    (config, shards, the index last), then stale weight files of earlier saves removed."""
    for name in written:
        _replace(staging / name, target / name)
    _fsync_dir(target)
    _remove_stale(target, set(written), sharded)


def _remove_stale(directory: Path, written: set[str], sharded: bool) -> None:
    """Deletes the weight files of an earlier save that the new one did not overwrite; runs after
    the new files (and index) are in place, so a crash in between leaves a loadable checkpoint."""
    stale = [
        entry
        for entry in directory.iterdir()
        if entry.name not in written
        and entry.is_file()
        and (
            _SHARD_RE.match(entry.name)
            or (sharded and entry.name == WEIGHTS_NAME)
            or (not sharded and entry.name == INDEX_NAME)
        )
    ]
    # The index goes first: shards without an index are never read, an index without shards is.
    for entry in sorted(stale, key=lambda e: e.name != INDEX_NAME):
        entry.unlink()
    if stale:
        _fsync_dir(directory)


__all__ = ["save_file", "save_pretrained", "parse_size", "tied_aliases", "TIED_KEY"]
