"""Reading safetensors files into torch tensors: ``safe_open`` and ``load_file``.

Every read goes through the Rust copy engine (:mod:`fastload._core`): the destination tensor is
allocated once, on its final dtype, and filled in parallel with the GIL released. Destinations on
an accelerator are filled through the bounded staging pipeline of :mod:`fastload.streaming`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from types import TracebackType

import torch

from fastload import _core
from fastload.dtypes import CONVERTIBLE, parse_dtype, to_st, to_torch
from fastload.errors import RequestError
from fastload.streaming import StagingPool

READ_MODES = ("pread", "mmap")

# (tensor name, destination tensor, selection) -- selection as _core.SafetensorsFile.copy_into takes
FillItem = tuple[str, torch.Tensor, "list[int] | None"]


def open_file(path: str | os.PathLike[str], read_mode: str = "pread") -> _core.SafetensorsFile:
    """Opens and validates one file; ``read_mode`` is ``"pread"`` (default) or ``"mmap"``."""
    if read_mode not in READ_MODES:
        raise RequestError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
    return _core.SafetensorsFile(os.fspath(path), read_mode)


def fill(
    file: _core.SafetensorsFile,
    items: Iterable[FillItem],
    threads: int | None = None,
    pool: StagingPool | None = None,
) -> int:
    """Fills destination tensors from ``file``; returns bytes written.

    CPU destinations are written in place (a non-contiguous one through a contiguous temporary),
    all in one Rust call that validates every one of them before writing a byte; destinations on
    other devices then go through :func:`fastload.streaming.stream_into`, one call per device,
    all staged through ``pool`` (default: one default-sized pool for this call).
    The caller must not free or resize a destination until this returns.
    """
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise RequestError(f"threads must be a positive int or None, got {threads!r}")
    jobs: list[tuple[str, int, int, str, list[int] | None]] = []
    keep: list[torch.Tensor] = []  # keeps temporaries alive until the copy is done
    after: list[tuple[torch.Tensor, torch.Tensor]] = []
    remote: dict[torch.device, list[FillItem]] = {}
    for name, dest, selection in items:
        if dest.device.type == "meta":
            raise RequestError(f"{file.path}: tensor {name!r}: a meta tensor has no memory to fill")
        if dest.device.type != "cpu":
            remote.setdefault(dest.device, []).append((name, dest, selection))
            continue
        target = dest if dest.is_contiguous() else torch.empty(dest.shape, dtype=dest.dtype)
        if target is not dest:
            after.append((dest, target))
        keep.append(target)
        jobs.append(
            (
                name,
                target.data_ptr(),
                target.numel() * target.element_size(),
                to_st(target.dtype),
                selection,
            )
        )
    written = file.copy_into(jobs, threads) if jobs else 0
    with torch.no_grad():  # destinations may be parameters that require grad
        for dest, target in after:
            dest.copy_(target)
    if remote:
        from fastload.streaming import stream_into

        pool = pool if pool is not None else StagingPool()
        for device_items in remote.values():
            written += stream_into(file, device_items, pool=pool, threads=threads)
    return written


class SafeOpen:
    """An open safetensors file, like ``safetensors.safe_open(path, framework="pt")``.

    The header is validated on open (``CheckpointError`` names the file and the broken rule).
    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        read_mode: str = "pread",
        threads: int | None = None,
        staging_bytes: int | str | None = None,
    ) -> None:
        self._file: _core.SafetensorsFile | None = open_file(path, read_mode)
        self.path = os.fspath(path)
        self.device = torch.device(device)
        self.threads = threads
        # One staging pool for the handle's lifetime: get_tensor calls to a GPU reuse its pinned
        # buffers instead of pinning new ones per tensor. Allocated on first use, freed on close.
        self.staging = StagingPool.sized(staging_bytes)

    @property
    def file(self) -> _core.SafetensorsFile:
        if self._file is None:
            raise RequestError(f"{self.path}: file is closed")
        return self._file

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return self.file.keys()

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` dict of the header, or ``None``."""
        return self.file.metadata()

    def dtype(self, name: str) -> torch.dtype:
        """The stored torch dtype of tensor ``name``."""
        return to_torch(self.file.info(name)[0], where=f"{self.path}: tensor {name!r}")

    def shape(self, name: str) -> torch.Size:
        """The shape of tensor ``name``."""
        return torch.Size(self.file.info(name)[1])

    def get_tensor(
        self,
        name: str,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` on ``device`` (default: the file's), converted to ``dtype`` if given."""
        st_dtype, shape, _, _ = self.file.info(name)
        stored = to_torch(st_dtype, where=f"{self.path}: tensor {name!r}")
        want = parse_dtype(dtype) if dtype is not None else stored
        device = torch.device(device) if device is not None else self.device
        direct = want == stored or (st_dtype in CONVERTIBLE and to_st(want) in CONVERTIBLE)
        out = torch.empty(shape, dtype=want if direct else stored, device=device)
        fill(self.file, [(name, out, None)], self.threads, self.staging)
        return out if direct else out.to(want)

    def load_into(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Fills existing tensors (by name) from the file in one parallel pass; returns bytes.

        Each destination's dtype decides the conversion; its number of elements must match.
        """
        return fill(
            self.file, [(k, t, None) for k, t in tensors.items()], self.threads, self.staging
        )

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
    device: str | torch.device = "cpu",
    *,
    read_mode: str = "pread",
    threads: int | None = None,
    staging_bytes: int | str | None = None,
) -> SafeOpen:
    """Drop-in for ``safetensors.safe_open`` (framework ``"pt"`` only).

    ``staging_bytes`` sizes the host staging pool used for accelerator destinations
    (default :data:`fastload.streaming.DEFAULT_STAGING_BYTES`, 128 MiB, pinned)."""
    if framework not in ("pt", "torch"):
        raise RequestError(f"fastload only produces torch tensors; framework={framework!r}")
    return SafeOpen(
        path, device=device, read_mode=read_mode, threads=threads, staging_bytes=staging_bytes
    )


def load_file(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    read_mode: str = "pread",
    threads: int | None = None,
    staging_bytes: int | str | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of a file, like ``safetensors.torch.load_file`` (same keys, bitwise equal).

    ``dtype`` converts floating-point tensors (F32/F16/BF16/F64) during the copy; other tensors
    keep their stored dtype. Accelerator destinations are staged through one host pool of
    ``staging_bytes`` (default 128 MiB, pinned), so host memory stays bounded by it.
    """
    pool = StagingPool.sized(staging_bytes)
    want = parse_dtype(dtype) if dtype is not None else None
    if want is not None and to_st(want) not in CONVERTIBLE:
        raise RequestError(f"dtype must be a floating-point type (F32/F16/BF16/F64), got {want}")
    file = open_file(path, read_mode)
    device = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    # Data order, as safetensors.torch.load_file returns them.
    for name, st_dtype, shape, _, _ in sorted(file.tensors(), key=lambda t: (t[3], t[4])):
        stored = to_torch(st_dtype, where=f"{os.fspath(path)}: tensor {name!r}")
        target = want if want is not None and st_dtype in CONVERTIBLE else stored
        out[name] = torch.empty(shape, dtype=target, device=device)
    fill(file, [(k, t, None) for k, t in out.items()], threads, pool)
    return out
