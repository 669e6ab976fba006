"""A file's pages in the page cache, for benchmarks and tests that start warm or cold."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

__all__ = ["evict", "resident_fraction", "warm"]


def warm(path: str | os.PathLike[str]) -> None:
    """Reads a file once so a loader starts from a warm page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def evict(path: str | os.PathLike[str]) -> None:
    """Drops a file's pages from the page cache (written back first, or they could not be)."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike[str]) -> float:
    """The fraction of a file's pages in the page cache, from ``mincore(2)`` on a private mapping
    that is never touched (so asking faults nothing in); ``nan`` where the kernel refuses."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        buf = (ctypes.c_char * size).from_buffer(m)
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
        del buf
        if rc:
            return float("nan")
        return sum(v & 1 for v in vec) / pages
