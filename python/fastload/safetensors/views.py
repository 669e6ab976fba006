"""``safe_open``'s tensors as views of the file, where a load would make them views too.

A loader that calls ``get_tensor`` for every key of one big file (ComfyUI's ``load_torch_file``)
gets from ``safetensors.safe_open`` views of a private mapping of the file: nothing is read until
the tensors are used, and then one page fault at a time. Copying each tensor into memory of its
own instead costs the kernel a fresh page per 4 KiB written, which is most of the time of such a
loop when the file is in the page cache. So ``fastload.safe_open`` hands out views under the same
rule as ``from_pretrained(mmap=...)`` (:func:`fastload.core.memory.sharing.file_sharing`): a whole
tensor, to the CPU, in its stored dtype, of a file on a local filesystem (``mmap="auto"``), with
an offset aligned for its dtype; everything else is read into memory of its own as before.

Views are copy-on-write (``MAP_PRIVATE``): writing one copies that page and never reaches the
file, and each view has a storage of its own that keeps the mapping alive after ``close()``.

A file mostly not in the page cache is read ahead once a caller has asked for views of an eighth
of its bytes (a loop over every key gets there at its first few keys; reading one tensor of a
large file does not start it): a helper thread reads the whole file into the page cache with
parallel reads and maps it (:meth:`~fastload.core.memory.sharing.SharedMapping.map_all`), within
the read-ahead room of the memory budget, so the views' first use finds their pages mapped
instead of faulting them in from the disk one by one.
"""

from __future__ import annotations

import os
import threading

import torch

from fastload import _core
from fastload.core.basics.dtypes import to_torch
from fastload.core.basics.errors import CheckpointError, FastloadError
from fastload.core.memory.budget import memory_budget
from fastload.core.memory.sharing import SharedMapping, check_mmap_mode, file_sharing

__all__ = ["FileViews", "stamp_of", "views_for"]

#: the share of a cold file's bytes asked for as views after which the rest is read ahead
READ_AHEAD_AFTER = 1 / 8


class FileViews:
    """Views of one open file's tensors, and its read-ahead (see the module)."""

    def __init__(self, file: _core.SafetensorsFile, stamp: tuple[int, int] | None) -> None:
        self._fd = file.fileno()
        self._stamp = stamp
        self.path = file.path
        self._check_unchanged()  # before mapping: the mapping would show the new bytes
        self.mapping = SharedMapping(file)
        self._names = {t[0] for t in file.tensors()}
        self._data = file.file_size - file.data_start
        self._asked = 0
        self._lock = threading.Lock()
        self._read_ahead: threading.Thread | None = None
        # asked once: ~5 ms per GiB; a file read since then is cached, which is no harm
        self._cold = file.mostly_uncached()

    def view(self, name: str, dtype: torch.dtype | None) -> torch.Tensor | None:
        """A view of tensor ``name`` (``dtype``: ``None`` or its stored dtype), or ``None`` where
        it must be read into memory of its own."""
        if name not in self._names:
            return None  # the copy's read names what is missing
        self._check_unchanged()
        mapping = self.mapping
        stored = mapping.view(name, dtype or _stored(mapping, name), track=False)
        if stored is None:
            return None
        if self._cold:
            self._asked += stored.numel() * stored.element_size()
            if self._asked >= self._data * READ_AHEAD_AFTER:
                self._start_read_ahead()
        return stored

    def _check_unchanged(self) -> None:
        """A file rewritten in place since it was opened is refused, as the copies' reads refuse
        it (a file replaced by rename is still the one opened: its descriptor is mapped)."""
        if self._stamp is None or self._fd is None:
            return
        now = stamp_of(self._fd)
        if now != self._stamp:
            raise CheckpointError(
                f"{self.path}: [file-changed] the file was rewritten in place since it was opened "
                f"(size {self._stamp[0]} -> {now[0]} bytes, modification time {self._stamp[1]} -> "
                f"{now[1]} ns); open it again"
            )

    def _start_read_ahead(self) -> None:
        with self._lock:
            if self._read_ahead is not None:
                return
            if not memory_budget().fits_read_ahead(self._data):
                self._cold = False  # pages read ahead would evict each other before first use
                return
            self._read_ahead = threading.Thread(
                target=self._map_all, name="fastload-safe-open-read-ahead", daemon=True
            )
            self._read_ahead.start()
            self._cold = False

    def _map_all(self) -> None:
        try:
            self.mapping.map_all()
        except FastloadError:
            pass  # a file cut short under the mapping: its views' first use says so


def _stored(mapping: SharedMapping, name: str) -> torch.dtype:
    return to_torch(mapping.file.info(name)[0], where=f"{mapping.path}: tensor {name!r}")


def stamp_of(fd: int) -> tuple[int, int]:
    """``(size, modification time in ns)`` of an open file."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def views_for(file: object, mmap: str, stamp: tuple[int, int] | None) -> FileViews | None:
    """The views of ``file`` under ``mmap`` (``"auto"``, ``"shared"``, ``"copy"``), or ``None``
    where its tensors are copies (object storage, a network filesystem under ``"auto"``,
    ``"copy"``). ``stamp``: the file's :func:`stamp_of` when it was opened."""
    check_mmap_mode(mmap)
    if not isinstance(file, _core.SafetensorsFile) or not file_sharing(file, mmap)[0]:
        return None
    return FileViews(file, stamp)
