"""The safetensors-compatible reading API: ``safe_open`` and ``load_file``.

The API and semantics are those of ``safetensors`` (``safe_open(path, framework="pt",
device=..., backend=...)`` with ``keys``, ``offset_keys``, ``metadata``, ``get_tensor``,
``get_tensors``, ``get_slice``), plus fastload's extras: ``dtype=`` conversion during the copy,
``threads=``, ``strict=``, ``staging_bytes=``, ``process_group=`` and ``load_into``. The reads are
:mod:`fastload.core.reads.reading`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import conversion_dtype, parse_dtype, to_torch, torch_shape
from fastload.core.basics.errors import RequestError
from fastload.core.basics.redaction import redact
from fastload.core.basics.threads import check_threads
from fastload.core.devices.checks import DeviceArg, parse_device
from fastload.core.memory.sharing import check_mmap_mode
from fastload.core.memory.staging import StagingPool
from fastload.core.reads.reading import (
    FillItem,
    allocate_all,
    fill,
    open_file,
    read_all,
    read_tensor,
    resolve_read_mode,
)
from fastload.safetensors.slices import SafeSlice
from fastload.safetensors.views import FileViews, stamp_of, views_for


def _float_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return conversion_dtype(dtype) if dtype is not None else None


class SafeOpen:
    """An open safetensors file, like ``safetensors.safe_open(path, framework="pt")``.

    The header is validated on open (``CheckpointError`` names the file and the broken rule).
    Use as a context manager or call :meth:`close`; a closed file raises ``RequestError``.

    With a ``process_group`` every read (``get_tensor``, ``get_tensors``, ``load_into``) is
    collective: every rank of the group makes the same calls in the same order, each reads about
    1/N of the bytes from storage and receives the rest (:mod:`fastload.distributed.collective`);
    the headers of the ranks' files are compared on open. ``get_slice`` reads on each rank alone.

    On the CPU, ``get_tensor`` of a whole tensor in its stored dtype gives a copy-on-write view of
    the file where ``from_pretrained`` would (``mmap="auto"``: a local filesystem; ``"shared"``:
    any; ``"copy"``: never), as ``safetensors.safe_open`` does, and reads a cold file ahead in
    parallel (:mod:`fastload.safetensors.views`); an explicit ``read_mode``/``backend`` asks
    for copies read that way.

    A handle may be shared between threads. Its reads to an accelerator go through its one staging
    pool and take turns there, one at a time (for reads in parallel: one :meth:`get_tensors` or
    :meth:`load_into` call, or a handle per thread).
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
        mmap: str = "auto",
    ) -> None:
        self.path = os.fspath(path)
        check_mmap_mode(mmap)
        self.device = parse_device(device, where=self.path)
        mode = resolve_read_mode(read_mode, backend)

        def opener() -> _core.SafetensorsFile:
            return open_file(path, mode, strict=strict, storage_options=storage_options)

        self._group: Any = None
        if process_group is not None:  # every rank opens, then learns whether all did
            from fastload.distributed import collective

            self._group = collective.RankGroup(process_group)
            self._file: _core.SafetensorsFile | None = collective.together(
                self._group, opener, "opening the file"
            )
        else:
            self._file = opener()
        self.threads = check_threads(threads, self.path)
        fd = self._file.fileno() if self._file is not None else None
        # the file as opened, for the views' check that it was not rewritten in place since
        self._stamp = stamp_of(fd) if fd is not None else None
        # views of the file for get_tensor, made on first use (None: copies)
        self._mmap = "copy" if (read_mode, backend) != (None, None) else mmap
        self._views: FileViews | None | bool = False
        # One staging pool for the handle's lifetime: get_tensor calls to a GPU reuse its pinned
        # buffers instead of pinning new ones per tensor. Allocated on first use, freed on close.
        self.staging = StagingPool.sized(staging_bytes)
        self._tensors: Any = None  # the file's table, as collective reads take it (built once)
        self._reads = 0  # collective reads made
        if self._group is not None:
            from fastload.distributed import collective

            assert self._file is not None
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
        target = parse_device(device, where=self.path) if device is not None else self.device
        if target.type == "cpu" and self._mmap != "copy":
            if self._views is False:
                self._views = views_for(self.file, self._mmap, self._stamp)
            if isinstance(self._views, FileViews):
                view = self._views.view(name, parse_dtype(dtype) if dtype is not None else None)
                if view is not None:
                    return view
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
            out = allocate_all(self.file, self.device, None)
            self.fill([(k, t, None) for k, t in out.items()])
            return out
        return read_all(self.file, self.device, None, self.threads, self.staging)

    def get_slice(self, name: str) -> SafeSlice:
        """A lazy view of tensor ``name``: ``get_shape()``, ``get_dtype()``, and indexing
        (``f.get_slice("w")[:, 0:128]``) that reads only the selected part from the file."""
        return SafeSlice(self, name)

    def fill(self, items: Iterable[FillItem]) -> int:
        """Fills ``(name, destination, selection)`` items with this file's thread setting."""
        if self._group is not None:
            from fastload.distributed import collective

            jobs = list(items)
            _ = self.file  # a closed handle raises
            self._reads += 1  # each read's first chunk from the next rank: small reads spread
            collective.read_collectively(
                self._group, self._tensors, jobs, threads=self.threads, turn=self._reads
            )
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
        self._views = None  # the views handed out keep their mapping alive
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
        return redact(f"SafeOpen({self.path!r}, device={str(self.device)!r})")


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
    mmap: str = "auto",
) -> SafeOpen:
    """``safetensors.safe_open`` for torch (``framework="pt"``).

    ``backend`` (safetensors' name) or ``read_mode``: ``"pread"`` (fastload's default) or
    ``"mmap"``. ``strict=True`` refuses what fastload otherwise reads as safetensors does (an
    unknown field in a tensor entry, ``"__metadata__": null``). ``staging_bytes`` sizes the host
    staging slots used for accelerator destinations (default
    :data:`fastload.core.memory.staging.DEFAULT_STAGING_BYTES`, 256 MiB, pinned; rounded down to
    whole slots, :meth:`fastload.core.memory.staging.StagingPool.sized`). ``process_group``:
    collective reads (see :class:`SafeOpen`).

    ``path`` may be an object storage URL (``s3://bucket/model.safetensors``, ``gs://``,
    ``az://``, ``http(s)://``): the header is read and validated on open, and each read fetches
    the tensor's bytes with parallel ranged GETs into its destination. ``storage_options``
    configures the store (endpoint, region, credentials, timeouts, retries; see
    :mod:`fastload.core.store.store_config`).

    ``mmap``: whether ``get_tensor`` to the CPU in the stored dtype gives views of the file
    (``"auto"``: on a local filesystem, ``"shared"``, ``"copy"``); see :class:`SafeOpen`.
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
        mmap=mmap,
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
    Accelerator destinations are staged through one ring of host slots of ``staging_bytes``
    (default 256 MiB, pinned; rounded down to whole slots, as in :func:`safe_open`), so host memory
    stays bounded by it.

    ``process_group`` (a ``torch.distributed`` group, e.g. ``dist.group.WORLD``): every rank of
    the group calls this on the same file (or its own copy of it), each reads about 1/N of the
    bytes from storage and the ranks exchange the rest (:mod:`fastload.distributed.collective`);
    every rank gets all the tensors.

    ``path`` may be an object storage URL (``s3://bucket/model.safetensors`` ...; see
    :func:`safe_open`): the tensors are read with parallel ranged GETs straight into them, with
    a progress bar when the file is large (``FASTLOAD_DISABLE_PROGRESS_BARS=1`` turns it off).
    """
    want = _float_dtype(dtype)
    device = parse_device(device, where=os.fspath(path))
    pool = StagingPool.sized(staging_bytes)
    mode = resolve_read_mode(read_mode, backend)

    def opener() -> _core.SafetensorsFile:
        return open_file(path, mode, strict=strict, storage_options=storage_options)

    if process_group is not None:
        return _load_collectively(opener, process_group, device, want, threads)
    file = opener()
    if file.remote:
        from fastload.core.basics.progress import byte_progress

        out = allocate_all(file, device, want)
        total = sum(t.numel() * t.element_size() for t in out.values())
        with byte_progress(total, True) as counter:
            fill(file, [(k, t, None) for k, t in out.items()], threads, pool, counter)
        pool.release()
        return out
    try:
        return read_all(file, device, want, threads, pool)
    finally:
        pool.release()  # a pinned slab stays with the process for the next load


def _load_collectively(
    opener: Callable[[], _core.SafetensorsFile],
    process_group: Any,
    device: torch.device,
    want: torch.dtype | None,
    threads: int | None,
) -> dict[str, torch.Tensor]:
    """:func:`load_file` with a process group: every rank opens the file (and learns whether
    all did), then they read it together."""
    from fastload.distributed import collective

    group = collective.RankGroup(process_group)
    file = collective.together(group, opener, "opening the file")
    ckpt = collective.Checkpoint.of_file(file)
    collective.check_same_checkpoint(group, ckpt)
    out = allocate_all(file, device, want)
    fills = [(name, tensor, None) for name, tensor in out.items()]
    collective.read_collectively(group, ckpt, fills, threads=threads)
    return out
