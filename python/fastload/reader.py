"""Reading safetensors files into torch tensors: ``safe_open`` and ``load_file``.

The API and semantics are those of ``safetensors`` (``safe_open(path, framework="pt",
device=..., backend=...)`` with ``keys``, ``offset_keys``, ``metadata``, ``get_tensor``,
``get_tensors``, ``get_slice``), plus fastload's extras: ``dtype=`` conversion during the copy,
``threads=``, ``strict=`` and ``load_into``.

Every read goes through the Rust copy engine (:mod:`fastload._core`): the destination tensor is
allocated once, on its final dtype, and filled in parallel with the GIL released. Destinations on
an accelerator are filled through the bounded staging pipeline of :mod:`fastload.streaming`.

A path may also be an object storage URL (``s3://bucket/model.safetensors``, ``gs://``,
``az://``, ``http(s)://``; :mod:`fastload.core.object_store`): the header is read first, then
the tensors with parallel ranged GETs into their destinations; ``storage_options`` configures the
store (:mod:`fastload.core.store_config`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from fastload import _core
from fastload.arguments import check_bool
from fastload.core import object_store
from fastload.devices import DeviceArg, parse_device
from fastload.dtypes import CONVERTIBLE, conversion_dtype, parse_dtype, to_st, to_torch, torch_shape
from fastload.engine import READ_MODES, CopyItem, TensorFile, copy_files, copy_into
from fastload.errors import RequestError, UnsupportedError
from fastload.slices import SafeSlice
from fastload.streaming import StagingPool
from fastload.threads import check_threads

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
    other devices then go through :func:`fastload.streaming.stream_into`, one call per device,
    all staged through ``pool`` (default: one default-sized pool for this call).
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
    (:func:`fastload.engine.copy_files`: the shards are read in parallel with each other);
    otherwise one call per file, in order. Destinations on other devices are staged per file."""
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
    together = together and any(f.mode == "ranged-get" for f, _ in prepared)
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
        from fastload.streaming import stream_into

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


def _read_all(
    file: _core.SafetensorsFile,
    device: torch.device,
    want: torch.dtype | None,
    threads: int | None,
    pool: StagingPool | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``file`` in data order (as safetensors returns them), floating-point
    ones converted to ``want`` during the copy when it is given."""
    out = _allocate_all(file, device, want)
    fill(file, [(k, t, None) for k, t in out.items()], threads, pool)
    return out


def _allocate_all(
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


def _float_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return conversion_dtype(dtype) if dtype is not None else None


class SafeOpen:
    """An open safetensors file, like ``safetensors.safe_open(path, framework="pt")``.

    The header is validated on open (``CheckpointError`` names the file and the broken rule).
    Use as a context manager or call :meth:`close`; a closed file raises ``RequestError``.

    With a ``process_group`` every read (``get_tensor``, ``get_tensors``, ``load_into``) is
    collective: every rank of the group makes the same calls in the same order, each reads about
    1/N of the bytes from storage and receives the rest (:mod:`fastload.collective`); the
    headers of the ranks' files are compared on open. ``get_slice`` reads on each rank alone.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: DeviceArg = "cpu",
        read_mode: str | None = None,
        backend: str | None = None,
        threads: int | None = None,
        strict: bool = False,
        staging_bytes: int | str | None = None,
        process_group: Any = None,
        storage_options: Mapping[str, object] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.device = parse_device(device, where=self.path)
        mode = resolve_read_mode(read_mode, backend)
        self._file: _core.SafetensorsFile | None = open_file(
            path, mode, strict=strict, storage_options=storage_options
        )
        self.threads = threads
        # One staging pool for the handle's lifetime: get_tensor calls to a GPU reuse its pinned
        # buffers instead of pinning new ones per tensor. Allocated on first use, freed on close.
        self.staging = StagingPool.sized(staging_bytes)
        self._group: Any = None
        self._tensors: Any = None  # the file's table, as collective reads take it (built once)
        if process_group is not None:
            from fastload import collective

            self._group = collective.RankGroup(process_group)
            self._tensors = collective.Checkpoint.of_file(self._file)
            collective.check_same_checkpoint(self._group, self._tensors)

    @property
    def file(self) -> _core.SafetensorsFile:
        if self._file is None:
            raise RequestError(f"{self.path}: file is closed")
        return self._file

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return self.file.keys()

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their data in the file."""
        return [t[0] for t in sorted(self.file.tensors(), key=lambda t: (t[3], t[4]))]

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` dict of the header, or ``None``."""
        return self.file.metadata()

    def dtype(self, name: str) -> torch.dtype:
        """The stored torch dtype of tensor ``name``."""
        return to_torch(self.file.info(name)[0], where=f"{self.path}: tensor {name!r}")

    def shape(self, name: str) -> torch.Size:
        """The shape of tensor ``name`` as the header stores it."""
        return torch.Size(self.file.info(name)[1])

    def get_tensor(
        self,
        name: str,
        device: DeviceArg | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` on ``device`` (default: the file's), converted to ``dtype`` if given."""
        if self._group is not None:
            st_dtype, shape, _, _ = self.file.info(name)
            where = f"{self.path}: tensor {name!r}"
            out = torch.empty(torch_shape(st_dtype, shape, where=where), dtype=to_torch(st_dtype))
            self.fill([(name, out, None)])
            target = parse_device(device, where=self.path) if device is not None else self.device
            return out.to(device=target, dtype=parse_dtype(dtype) if dtype is not None else None)
        return read_tensor(
            self.file,
            name,
            device=parse_device(device, where=self.path) if device is not None else self.device,
            dtype=parse_dtype(dtype) if dtype is not None else None,
            threads=self.threads,
            pool=self.staging,
        )

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, in the order of their data in the file, read in one parallel pass."""
        if self._group is not None:
            out = _allocate_all(self.file, self.device, None)
            self.fill([(k, t, None) for k, t in out.items()])
            return out
        return _read_all(self.file, self.device, None, self.threads, self.staging)

    def get_slice(self, name: str) -> SafeSlice:
        """A lazy view of tensor ``name``: ``get_shape()``, ``get_dtype()``, and indexing
        (``f.get_slice("w")[:, 0:128]``) that reads only the selected part from the file."""
        return SafeSlice(self, name)

    def fill(self, items: Iterable[FillItem]) -> int:
        """Fills ``(name, destination, selection)`` items with this file's thread setting."""
        if self._group is not None:
            from fastload import collective

            jobs = list(items)
            _ = self.file  # a closed handle raises
            collective.read_collectively(self._group, self._tensors, jobs, threads=self.threads)
            return sum(t.numel() * t.element_size() for _, t, _ in jobs)
        return fill(self.file, items, self.threads, self.staging)

    def load_into(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Fills existing tensors (by name) from the file in one parallel pass; returns bytes.

        Each destination's dtype decides the conversion; its number of elements must match.
        """
        if not isinstance(tensors, Mapping):
            raise TypeError(f"load_into takes a dict of name to tensor, got {type(tensors)}")
        return self.fill([(k, t, None) for k, t in tensors.items()])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.file

    def close(self) -> None:
        self._file = None
        self.staging.release()

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafeOpen({self.path!r}, device={str(self.device)!r})"


def safe_open(
    path: str | os.PathLike[str],
    framework: str = "pt",
    device: DeviceArg = "cpu",
    *,
    backend: str | None = None,
    read_mode: str | None = None,
    threads: int | None = None,
    strict: bool = False,
    staging_bytes: int | str | None = None,
    process_group: Any = None,
    storage_options: Mapping[str, object] | None = None,
) -> SafeOpen:
    """``safetensors.safe_open`` for torch (``framework="pt"``).

    ``backend`` (safetensors' name) or ``read_mode``: ``"pread"`` (fastload's default) or
    ``"mmap"``. ``strict=True`` refuses what fastload otherwise reads as safetensors does (an
    unknown field in a tensor entry, ``"__metadata__": null``). ``staging_bytes`` sizes the host
    staging pool used for accelerator destinations (default
    :data:`fastload.streaming.DEFAULT_STAGING_BYTES`, 128 MiB, pinned). ``process_group``:
    collective reads (see :class:`SafeOpen`).

    ``path`` may be an object storage URL (``s3://bucket/model.safetensors``, ``gs://``,
    ``az://``, ``http(s)://``): the header is read and validated on open, and each read fetches
    the tensor's bytes with parallel ranged GETs into its destination. ``storage_options``
    configures the store (endpoint, region, credentials, timeouts, retries; see
    :mod:`fastload.core.store_config`).
    """
    if framework not in ("pt", "torch"):
        raise RequestError(f"fastload only produces torch tensors; framework={framework!r}")
    return SafeOpen(
        path,
        device=device,
        read_mode=read_mode,
        backend=backend,
        threads=threads,
        strict=strict,
        staging_bytes=staging_bytes,
        process_group=process_group,
        storage_options=storage_options,
    )


def load_file(
    path: str | os.PathLike[str],
    device: DeviceArg = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    backend: str | None = None,
    read_mode: str | None = None,
    threads: int | None = None,
    strict: bool = False,
    staging_bytes: int | str | None = None,
    process_group: Any = None,
    storage_options: Mapping[str, object] | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a file, like ``safetensors.torch.load_file`` (same keys, bitwise equal).

    ``dtype`` converts floating-point tensors (F32/F16/BF16/F64) during the copy; other tensors
    keep their stored dtype. ``backend``/``read_mode`` and ``strict`` as in :func:`safe_open`.
    Accelerator destinations are staged through one host pool of ``staging_bytes`` (default
    128 MiB, pinned), so host memory stays bounded by it.

    ``process_group`` (a ``torch.distributed`` group, e.g. ``dist.group.WORLD``): every rank of
    the group calls this on the same file (or its own copy of it), each reads about 1/N of the
    bytes from storage and the ranks exchange the rest (:mod:`fastload.collective`); every rank
    gets all the tensors.

    ``path`` may be an object storage URL (``s3://bucket/model.safetensors`` ...; see
    :func:`safe_open`): the tensors are read with parallel ranged GETs straight into them, with
    a progress bar when the file is large (``FASTLOAD_DISABLE_PROGRESS_BARS=1`` turns it off).
    """
    want = _float_dtype(dtype)
    device = parse_device(device, where=os.fspath(path))
    pool = StagingPool.sized(staging_bytes)
    file = open_file(
        path,
        resolve_read_mode(read_mode, backend),
        strict=strict,
        storage_options=storage_options,
    )
    if process_group is None and file.mode == "ranged-get":
        from fastload.progress import byte_progress

        out = _allocate_all(file, device, want)
        total = sum(t.numel() * t.element_size() for t in out.values())
        with byte_progress(total, True) as counter:
            fill(file, [(k, t, None) for k, t in out.items()], threads, pool, counter)
        return out
    if process_group is None:
        return _read_all(file, device, want, threads, pool)
    from fastload import collective

    group = collective.RankGroup(process_group)
    ckpt = collective.Checkpoint.of_file(file)
    collective.check_same_checkpoint(group, ckpt)
    out = _allocate_all(file, device, want)
    fills = [(name, tensor, None) for name, tensor in out.items()]
    collective.read_collectively(group, ckpt, fills, threads=threads)
    return out
