"""A file's pages in the page cache, for benchmarks and tests that start warm or cold."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["evict", "warm"]


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
