"""Reading a checkpoint file's tensors into destination tensors: the read step of every load.

Opening and validating a file (:func:`open_file`, the read path :func:`resolve_read_mode`),
filling caller-allocated destinations (:func:`fill`), reading one tensor or a selection of it
(:func:`read_tensor`) and every tensor of a file (:func:`read_all`). The safetensors-compatible
API (``safe_open``, ``load_file``) is built on these in :mod:`fastload.safetensors.files`.

Every read goes through the Rust copy engine (:mod:`fastload._core`): the destination tensor is
allocated once, on its final dtype, and filled in parallel with the GIL released. Destinations on
an accelerator are filled through the bounded staging pipeline of
:mod:`fastload.core.reads.streaming`.

A path may also be an object storage URL (``s3://bucket/model.safetensors``, ``gs://``,
``az://``, ``http(s)://``; :mod:`fastload.core.store.object_store`): the header is read first, then
the tensors with parallel ranged GETs into their destinations; ``storage_options`` configures the
store (:mod:`fastload.core.store.store_config`). The files of a checkpoint in object storage are
filled in one engine call (:func:`fill_many`), their requests in parallel with each other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.arguments import check_bool
from fastload.core.basics.dtypes import (
    CONVERTIBLE,
    to_st,
    to_torch,
    torch_shape,
)
from fastload.core.basics.engine import READ_MODES, CopyItem, TensorFile, copy_files, copy_into
from fastload.core.basics.errors import RequestError, UnsupportedError
from fastload.core.basics.progress import byte_progress
from fastload.core.basics.threads import check_threads
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.memory.staging import StagingPool
from fastload.core.store import object_store

# (tensor name, destination tensor, selection): selection as the engine takes it (engine.copy_into)
FillItem = tuple[str, torch.Tensor, "list[int] | None"]


def resolve_read_mode(read_mode: str | None, backend: str | None) -> str:
    """The read path from fastload's ``read_mode`` or safetensors' name for it, ``backend``
    (``"mmap"`` or ``"pread"`` in both); fastload's default is ``"pread"``."""
    for option, value in (("read_mode", read_mode), ("backend", backend)):
        if value is not None and value not in READ_MODES:
            raise RequestError(f"{option} must be one of {READ_MODES}, got {value!r}")
    if read_mode is not None and backend is not None and read_mode != backend:
        raise RequestError(f"read_mode={read_mode!r} and backend={backend!r} disagree; pass one")
    return read_mode or backend or "pread"


def open_file(
    path: str | os.PathLike[str],
    read_mode: str = "pread",
    *,
    strict: bool = False,
    storage_options: Mapping[str, object] | None = None,
) -> _core.SafetensorsFile:
    """Opens and validates one file; ``read_mode`` is ``"pread"`` (default) or ``"mmap"``.

    ``strict`` also refuses what the safetensors crate accepts and fastload reads by default
    (an unknown field in a tensor entry, ``"__metadata__": null``). An object storage URL is
    read with ranged GETs (``read_mode`` does not apply; ``"mmap"`` is refused), configured by
    ``storage_options``.
    """
    if read_mode not in READ_MODES:
        raise RequestError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    check_bool(strict, "strict", where=os.fspath(path))
    if object_store.is_url(path):
        assert isinstance(path, str)
        if read_mode == "mmap":
            raise RequestError(
                f"{path}: read_mode='mmap' needs a local file; an object in object storage is "
                "read with ranged GETs"
            )
        return object_store.open_file(path, storage_options, strict=strict)
    if storage_options is not None:
        raise RequestError(
            f"{os.fspath(path)}: storage_options apply to object storage URLs (s3://, gs://, "
            "az://, http(s)://), not to local files"
        )
    return _core.SafetensorsFile(os.fspath(path), read_mode, strict=strict)


def _check_destination(where: str, name: str, dest: object) -> torch.Tensor:
    """A destination the engine can fill: a dense tensor whose elements do not share memory."""
    if not isinstance(dest, torch.Tensor):
        raise UnsupportedError(
            f"{where}: tensor {name!r}: the destination is a {type(dest).__name__}, not a tensor"
        )
    if dest.layout != torch.strided or dest.is_nested:
        raise UnsupportedError(
            f"{where}: tensor {name!r}: the destination has layout {dest.layout}; only dense "
            "tensors can be filled"
        )
    if dest.numel() > 1 and dest.device.type != "meta":
        reach = sum((n - 1) * abs(s) for n, s in zip(dest.shape, dest.stride(), strict=True))
        if reach + 1 < dest.numel():
            raise RequestError(
                f"{where}: tensor {name!r}: the destination's elements share memory (an "
                ".expand()ed tensor?); fill a tensor of its own, e.g. .clone() it"
            )
    return dest


def fill(
    file: TensorFile,
    items: Iterable[FillItem],
    threads: int | None = None,
    pool: StagingPool | None = None,
    progress: _core.Progress | None = None,
) -> int:
    """Fills destination tensors from ``file``; returns bytes written.

    ``progress`` counts the bytes written as the copy goes and can cancel it
    (``LoadCancelledError``).
    CPU destinations are written in place (a non-contiguous one through a contiguous temporary),
    all in one Rust call that validates every one of them before writing a byte; destinations on
    other devices then go through :func:`fastload.core.reads.streaming.stream_into`, one call per
    device, all staged through ``pool`` (default: one default-sized pool for this call).
    The caller must not free or resize a destination until this returns.
    """
    return fill_many([(file, items)], threads, pool, progress)


def fill_many(
    work: Sequence[tuple[TensorFile, Iterable[FillItem]]],
    threads: int | None = None,
    pool: StagingPool | None = None,
    progress: _core.Progress | None = None,
) -> int:
    """:func:`fill` for the items of several files. Their CPU destinations are filled in one
    engine call when every file is a safetensors file and one of them is in object storage
    (:func:`fastload.core.basics.engine.copy_files`: the shards are read in parallel with each
    other); otherwise one call per file, in order. Destinations on other devices are staged per
    file."""
    prepared: list[tuple[TensorFile, list[CopyItem]]] = []
    after: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged: list[tuple[TensorFile, dict[torch.device, list[FillItem]]]] = []
    for file, items in work:
        check_threads(threads, file.path)
        jobs: list[CopyItem] = []  # hold the contiguous temporaries until the copy is done
        remote: dict[torch.device, list[FillItem]] = {}
        for name, dest, selection in items:
            _check_destination(file.path, name, dest)
            if dest.device.type == "meta":
                raise RequestError(
                    f"{file.path}: tensor {name!r}: a meta tensor has no memory to fill"
                )
            if dest.device.type != "cpu":
                remote.setdefault(dest.device, []).append((name, dest, selection))
                continue
            target = (
                dest
                if dest.is_contiguous()
                else torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
            )
            if target is not dest:
                after.append((dest, target))
            jobs.append((name, target, to_st(target.dtype), selection))
        prepared.append((file, jobs))
        if remote:
            staged.append((file, remote))
    together = len(prepared) > 1 and all(isinstance(f, _core.SafetensorsFile) for f, _ in prepared)
    together = together and any(object_store.is_remote(f) for f, _ in prepared)
    written = 0
    if together:
        files = [(f, jobs) for f, jobs in prepared if jobs]
        written = copy_files(files, threads, progress) if files else 0  # type: ignore[arg-type]
    else:
        for file, jobs in prepared:
            written += copy_into(file, jobs, threads, progress) if jobs else 0
    with torch.no_grad():  # destinations may be parameters that require grad
        for dest, target in after:
            dest.copy_(target)
    if staged:
        from fastload.core.reads.streaming import stream_into

        pool = pool if pool is not None else StagingPool()
        for file, by_device in staged:
            for device_items in by_device.values():
                written += stream_into(
                    file, device_items, pool=pool, threads=threads, progress=progress
                )
    return written


def read_tensor(
    file: _core.SafetensorsFile,
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    threads: int | None = None,
    pool: StagingPool | None = None,
) -> torch.Tensor:
    """Tensor ``name`` of the open ``file`` as a new tensor on ``device``, converted to ``dtype``
    (default: the stored one) during the copy where the engine can, after it otherwise."""
    st_dtype, shape, _, _ = file.info(name)
    where = f"{file.path}: tensor {name!r}"
    stored = to_torch(st_dtype, where=where)
    want = dtype if dtype is not None else stored
    direct = want == stored or (st_dtype in CONVERTIBLE and to_st(want) in CONVERTIBLE)
    out = torch.empty(
        torch_shape(st_dtype, shape, where=where), dtype=want if direct else stored, device=device
    )
    fill(file, [(name, out, None)], threads, pool)
    return out if direct else out.to(want)


def read_all(
    file: _core.SafetensorsFile,
    device: torch.device,
    want: torch.dtype | None,
    threads: int | None,
    pool: StagingPool | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``file`` in data order (as safetensors returns them), floating-point
    ones converted to ``want`` during the copy when it is given."""
    out = allocate_all(file, device, want)
    fill(file, [(k, t, None) for k, t in out.items()], threads, pool)
    return out


def allocate_all(
    file: _core.SafetensorsFile, device: torch.device, want: torch.dtype | None
) -> dict[str, torch.Tensor]:
    """An empty destination for every tensor of ``file``, in data order."""
    out: dict[str, torch.Tensor] = {}
    for name, st_dtype, shape, _, _ in sorted(file.tensors(), key=lambda t: (t[3], t[4])):
        where = f"{file.path}: tensor {name!r}"
        stored = to_torch(st_dtype, where=where)
        target = want if want is not None and st_dtype in CONVERTIBLE else stored
        out[name] = torch.empty(
            torch_shape(st_dtype, shape, where=where), dtype=target, device=device
        )
    return out


def validate(path: str | os.PathLike[str], *, strict: bool = False) -> int:
    """Checks one file's header by every rule of the format without reading tensor data;
    returns the number of tensors (``CheckpointError`` naming the file and the rule)."""
    return _core.validate(path, strict=strict)


def read_every_byte(file: TensorFile, chunk_bytes: int = 16 << 20) -> int:
    """Reads every byte of every tensor of ``file`` through the copy engine into one scratch
    buffer of ``chunk_bytes``; returns the bytes read. Catches what header checks cannot: I/O
    errors and a file that shrank after it was opened.

    Tensors are read in file order, as many as fill the buffer per engine call (a larger one in
    pieces), so the engine reads them as a load does: neighbours in one request, requests in
    parallel (an object in object storage with 10^4 small tensors is a few ranged GETs, not
    10^4 in sequence)."""
    bits = _core.dtype_bits()
    scratch = torch.empty(chunk_bytes, dtype=torch.uint8)
    batch: list[CopyItem] = []
    used = total = 0

    def add(name: str, st_dtype: str, length: int, selection: list[int] | None) -> None:
        nonlocal used, total, batch
        if used + length > chunk_bytes:
            copy_into(file, batch)
            batch, used = [], 0
        batch.append((name, scratch[used : used + length], st_dtype, selection))
        used += length
        total += length

    for name, st_dtype, shape, begin, end in sorted(file.tensors(), key=lambda t: t[3]):
        nbytes = end - begin
        if bits[st_dtype] % 8:  # a packed sub-byte type: only whole tensors can be read
            if nbytes > chunk_bytes:
                copy_into(file, [(name, torch.empty(nbytes, dtype=torch.uint8), st_dtype, None)])
                total += nbytes
            else:
                add(name, st_dtype, nbytes, None)
            continue
        itemsize = bits[st_dtype] // 8
        numel = math.prod(shape)
        step = max(1, chunk_bytes // itemsize)
        for start in range(0, numel, step):
            stop = min(numel, start + step)
            add(name, st_dtype, (stop - start) * itemsize, [start, stop])
    if batch:
        copy_into(file, batch)
    return total


def fill_checkpoint(
    ckpt: OpenCheckpoint,
    by_file: dict[int, list[Any]],
    *,
    threads: int | None,
    progress: bool | Callable[[int], AbstractContextManager[_core.Progress]],
    pool: StagingPool,
) -> int:
    """Fills ``by_file`` (file index -> its :class:`~fastload.core.reads.allocation.Fill` items):
    one copy call per file (all its tensors at once, so the engine parallelises across them),
    or one for every file of a checkpoint in object storage (the shards read in parallel with
    each other); the progress bar advances per copied piece (:mod:`fastload.core.basics.progress`);
    accelerator destinations of every file share ``pool``, released at the end. ``progress``:
    whether to draw a bar of the load's own, or what gives the counter of the copies from their
    total bytes (a session's bar, :mod:`fastload.core.reads.session`)."""
    total = sum(f.tensor.numel() * f.tensor.element_size() for fs in by_file.values() for f in fs)
    work = [(ckpt.files[index], by_file[index]) for index in sorted(by_file)]
    bar = progress(total) if callable(progress) else byte_progress(total, progress)
    with bar as counter:
        try:
            if any(object_store.is_remote(file) for file, _ in work):
                # one copy for every file: the shards' requests in parallel with each other
                return fill_many(work, threads, pool, counter)
            return sum(fill(file, fills, threads, pool, counter) for file, fills in work)
        finally:
            pool.release()
