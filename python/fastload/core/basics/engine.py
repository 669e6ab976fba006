"""The one door to the Rust engine's raw copy.

``_core.SafetensorsFile._copy_into`` writes to raw addresses: any caller holding an integer could
corrupt memory with it. :func:`copy_into` is the only caller: it takes tensors and derives each
address and byte length from the tensor itself, keeping the tensors alive for the call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from fastload import _core
from fastload.core.basics.errors import RequestError

#: the engine's ways of reading a file: positioned reads (no page faults) or a mapping (an object
#: in object storage is read with ranged GETs, its mode ``"ranged-get"``, never asked for)
READ_MODES = ("pread", "mmap")

#: (tensor name, destination, dtype wanted as a safetensors name, selection) for
#: :func:`copy_into`: the destination's bytes receive the tensor (or its selection) in that dtype.
#: A selection is ``None`` (the whole tensor), ``[start, stop]`` (a flat range of elements),
#: ``[dim, start, stop]`` (a range of one dimension) or ``[first row, rows, row length, start,
#: stop]`` (the same elements of each of a block of rows of the flattened tensor)
CopyItem = tuple[str, torch.Tensor, str, "list[int] | None"]


class TensorFile(Protocol):
    """An opened checkpoint file the pipeline reads: ``_core.SafetensorsFile`` (validated by
    Rust) or :class:`~fastload.core.checkpoint.pickle_file.PickleFile` (a pickle or an in-memory
    state dict, behaving like one)."""

    @property
    def path(self) -> str: ...

    @property
    def mode(self) -> str: ...

    def keys(self) -> list[str]: ...

    def metadata(self) -> dict[str, str] | None: ...

    def tensors(self) -> list[tuple[str, str, list[int], int, int]]: ...

    def info(self, name: str) -> tuple[str, list[int], int, int]: ...

    def _copy_into(
        self, jobs: list[Any], threads: int | None = None, progress: Any | None = None
    ) -> int: ...


def _jobs(
    file: TensorFile, items: Iterable[CopyItem], keep: list[torch.Tensor]
) -> list[tuple[str, int, int, str, list[int] | None]]:
    """The engine's jobs for ``items`` (addresses and lengths taken from the tensors, which
    ``keep`` holds until the copy is done)."""
    jobs: list[tuple[str, int, int, str, list[int] | None]] = []
    for name, dest, st_dtype, selection in items:
        if not isinstance(dest, torch.Tensor) or dest.device.type != "cpu":
            raise RequestError(f"{file.path}: tensor {name!r}: the destination is not a CPU tensor")
        if not dest.is_contiguous():
            raise RequestError(f"{file.path}: tensor {name!r}: the destination is not contiguous")
        keep.append(dest)
        jobs.append(
            (name, dest.data_ptr(), dest.numel() * dest.element_size(), st_dtype, selection)
        )
    return jobs


def copy_into(
    file: TensorFile,
    items: Iterable[CopyItem],
    threads: int | None = None,
    progress: _core.Progress | None = None,
) -> int:
    """The one door to the engine's raw copy (``file._copy_into``): each destination is a
    contiguous CPU tensor whose address and byte length are taken from the tensor itself, and
    which this call keeps alive until the copy is done. Returns the bytes written.

    ``file`` is a ``_core.SafetensorsFile`` or a
    :class:`~fastload.core.checkpoint.pickle_file.PickleFile` (the same interface). The engine
    validates every item before it writes a byte."""
    keep: list[torch.Tensor] = []
    jobs = _jobs(file, items, keep)
    written: int = file._copy_into(jobs, threads, progress)
    return written


def copy_files(
    work: Sequence[tuple[_core.SafetensorsFile, Iterable[CopyItem]]],
    threads: int | None = None,
    progress: _core.Progress | None = None,
) -> int:
    """:func:`copy_into` for several safetensors files at once: one engine call whose tasks, from
    every file, share one pool (the shards of a checkpoint in object storage are read in
    parallel with each other). Returns the bytes written."""
    keep: list[torch.Tensor] = []
    items = [(file, _jobs(file, file_items, keep)) for file, file_items in work]
    written: int = _core._copy_files(items, threads, progress)
    return written


__all__ = ["CopyItem", "copy_files", "copy_into"]
