"""A rank's chunks of local files in a collective load, read with positioned reads of exactly
their bytes (:class:`FileReader`), ahead of the exchange
(:func:`fastload.distributed.collective.read_collectively`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fastload.core.basics.errors import CheckpointError, FastloadIOError
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.distributed.read_ahead import ReadAhead

#: chunks a rank may read ahead of the exchange
READ_AHEAD_CHUNKS = 2
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: pieces one chunk's read is split into across threads
_READ_PIECE = 4 << 20


@dataclass(frozen=True)
class Chunk:
    """File bytes ``[start, stop)`` of file ``file``, read by rank ``owner``."""

    file: int
    start: int
    stop: int
    owner: int = 0

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


class Files(Protocol):
    """What a reader needs of a checkpoint: its opened files (an :class:`OpenCheckpoint`, or a
    collective read's :class:`~fastload.distributed.collective.Checkpoint`)."""

    @property
    def files(self) -> Sequence[Any]: ...


class FileReader(ReadAhead):
    """Reads this rank's chunks in order on a helper thread, at most :data:`READ_AHEAD_CHUNKS`
    ahead of the exchange, each with parallel positioned reads of exactly its bytes.

    A chunk mostly not in the page cache is read with ``O_DIRECT``: from storage, exactly its
    pages, and without caching them. Buffered reads of a cold file would not stay within the
    rank's part: the pages the header read brought in carry read-ahead marks, and from them the
    kernel reads far ahead into the next rank's part (measured on Linux 6.18: a rank reading
    15.7 MB of a 29 MB file left 25 MB cached, even with ``POSIX_FADV_RANDOM``). The bytes go
    into the rank's own tensors anyway: caching them too would hold the model twice. A cached
    chunk (or a filesystem without ``O_DIRECT``) is read through the page cache."""

    thread_name = "fastload-collective"

    def __init__(
        self,
        ckpt: OpenCheckpoint | Files,
        chunks: list[Chunk],
        device: torch.device,
        threads: int | None,
    ) -> None:
        self.ckpt = ckpt
        self.chunks = chunks
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.direct: dict[int, int | None] = {}  # file index -> O_DIRECT descriptor
        # room for a chunk widened to whole pages at both ends, plus alignment of the start
        size = max((c.nbytes for c in chunks), default=0) + 3 * PAGE
        super().__init__(len(chunks), size, READ_AHEAD_CHUNKS, device)

    def _session(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.threads, thread_name_prefix="fastload-pread")

    def _fill(self, index: int, buffer: torch.Tensor, session: Any) -> torch.Tensor:
        return self._read(session, self.chunks[index], buffer)

    def _close(self) -> None:
        for fd in self.direct.values():
            if fd is not None:
                os.close(fd)

    def _direct_fd(self, index: int) -> int | None:
        """An ``O_DIRECT`` descriptor of the validated file (``None`` where there is none)."""
        if index not in self.direct:
            fd = None
            flag = getattr(os, "O_DIRECT", 0)
            own = self.ckpt.files[index].fileno()  # type: ignore[union-attr]
            if flag and own is not None and os.path.exists(f"/proc/self/fd/{own}"):
                try:  # the descriptor's own file, even if the path was replaced since
                    fd = os.open(f"/proc/self/fd/{own}", os.O_RDONLY | flag)
                except OSError:  # tmpfs and some FUSE filesystems refuse O_DIRECT
                    fd = None
            self.direct[index] = fd
        return self.direct[index]

    def _read(self, pool: ThreadPoolExecutor, chunk: Chunk, buffer: torch.Tensor) -> torch.Tensor:
        """Reads ``chunk`` into ``buffer``; returns the view of ``buffer`` holding its bytes."""
        file = self.ckpt.files[chunk.file]
        fd = None
        if file.mostly_uncached(chunk.start, chunk.nbytes):  # type: ignore[union-attr]
            fd = self._direct_fd(chunk.file)
        if fd is not None:
            first = chunk.start // PAGE * PAGE
            last = -(-chunk.stop // PAGE) * PAGE
            skew = -buffer.data_ptr() % PAGE  # O_DIRECT needs a page-aligned buffer
            window = buffer[skew : skew + last - first]
            try:
                _read_all(pool, file.path, fd, window, first, last, exact=False)
                return window[chunk.start - first : chunk.stop - first]
            except OSError:  # the filesystem refused this O_DIRECT read: read it buffered
                pass
        view = buffer[: chunk.nbytes]
        own = file.fileno()  # type: ignore[union-attr]
        _read_all(pool, file.path, own, view, chunk.start, chunk.stop, exact=True)
        return view


def _read_all(
    pool: ThreadPoolExecutor,
    path: str,
    fd: int,
    out: torch.Tensor,
    start: int,
    stop: int,
    *,
    exact: bool,
) -> None:
    """Reads file bytes ``[start, stop)`` into ``out`` in :data:`_READ_PIECE` pieces on
    ``pool``'s threads. ``exact=False`` (an ``O_DIRECT`` read of whole pages) accepts the file
    ending before ``stop`` (the last page is partial)."""
    pieces = [(a, min(stop, a + _READ_PIECE)) for a in range(start, stop, _READ_PIECE)]
    memory = memoryview(out.numpy())
    reads = [pool.submit(_pread, path, fd, memory, start, a, b, exact) for a, b in pieces]
    for read in reads:
        read.result()


def _pread(
    path: str, fd: int, memory: memoryview, base: int, start: int, stop: int, exact: bool
) -> None:
    done = start
    while done < stop:
        try:
            got = os.preadv(fd, [memory[done - base : stop - base]], done)
        except OSError as e:
            if not exact:
                raise  # the caller reads buffered instead
            raise FastloadIOError(f"{path}: reading bytes {done}..{stop} failed: {e}") from e
        if got == 0:
            if not exact:
                return
            raise CheckpointError(
                f"{path}: [file-changed] the file ended at byte {done}, before the {stop} its "
                "header promises; it was truncated while loading"
            )
        done += got


__all__ = ["PAGE", "READ_AHEAD_CHUNKS", "Chunk", "FileReader", "Files"]
