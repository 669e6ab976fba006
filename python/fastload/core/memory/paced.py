"""Read-ahead paced by the first forward, for models larger than the memory a load may use.

When the views of a load do not fit its memory budget (:mod:`fastload.core.memory.budget`), reading
them all ahead would evict the first ones before the forward reaches them, and reading none leaves
the forward waiting on one page fault's read at a time. :class:`PacedReadAhead` reads the views into
the page cache in the order they were handed out (the model's registration order, which its
first forward follows), in a helper thread, never more than ``room`` bytes ahead of the forward.

The forward's progress is read from the page tables: a view's pages are *present* in this
process (``/proc/self/pagemap``) once the forward has touched them, and the helper reads into the
page cache only (``sendfile`` to /dev/null), never mapping a page itself. Views the forward has
passed are marked cold (``MADV_COLD``) so that the kernel reclaims them first, not the pages read
ahead for the layers still to come; each byte is read from storage once. The helper stops when
every view is read, or when the forward makes no progress for :data:`STALL_SECONDS` (no forward
runs yet): the rest is then read on first use.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

#: bytes read ahead of the forward at most (besides the view being read): enough to keep the
#: disk busy while the forward computes; more only adds memory pressure (measured in the
#: low-RAM benchmark, fastload.tools.bench.lowram)
AHEAD = 64 << 20
#: seconds without progress of the forward after which the helper stops
STALL_SECONDS = 30.0
#: bytes per sendfile call
CHUNK = 8 << 20
#: parallel reads (the disk serves parallel requests best)
READERS = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_COLD = 20


def supported() -> bool:
    """Whether the page tables can be read here (Linux, /proc mounted)."""
    return hasattr(os, "sendfile") and os.path.exists("/proc/self/pagemap")


class PacedReadAhead:
    """Reads ``views`` (``(mapping, file offset, bytes)``, in the order of first use) ahead of
    their first use, at most ``room`` bytes ahead, in a daemon thread started at once."""

    def __init__(self, views: Sequence[tuple[Any, int, int]], room: int) -> None:
        self.views = list(views)
        self.room = room
        self.read = 0  # bytes read so far
        self._thread = threading.Thread(target=self._run, name="fastload-paced", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _touched(self, pagemap: int, index: int) -> bool:
        mapping, offset, n = self.views[index]
        for address in (mapping.address + offset, mapping.address + offset + n - 1):
            entry = os.pread(pagemap, 8, address // _PAGE * 8)
            if len(entry) == 8 and int.from_bytes(entry, "little") >> 63:
                return True
        return False

    def _run(self) -> None:
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
        except OSError:
            return
        from concurrent.futures import ThreadPoolExecutor

        libc = ctypes.CDLL(None, use_errno=True)
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="fastload-paced")
        sizes = [n for _, _, n in self.views]
        passed, cold = -1, 0  # last view the forward touched; views marked cold so far
        last_progress = time.monotonic()
        try:
            nxt = 0
            while nxt < len(self.views):
                for j in range(nxt - 1, passed, -1):  # the furthest view touched
                    if self._touched(pagemap, j):
                        passed, last_progress = j, time.monotonic()
                        break
                while cold < passed:  # behind the forward: reclaim these first
                    mapping, offset, n = self.views[cold]
                    libc.madvise(
                        ctypes.c_void_p((mapping.address + offset) // _PAGE * _PAGE),
                        ctypes.c_size_t(n + (mapping.address + offset) % _PAGE),
                        _MADV_COLD,
                    )
                    cold += 1
                ahead = sum(sizes[passed + 1 : nxt])
                if ahead and ahead + sizes[nxt] > self.room:
                    if time.monotonic() - last_progress > STALL_SECONDS:
                        return
                    time.sleep(0.002)
                    continue
                self._read(*self.views[nxt])
                nxt += 1
        finally:
            os.close(pagemap)
            self._pool.shutdown(wait=False)

    def _read(self, mapping: Any, offset: int, n: int) -> None:
        fd = mapping.file.fileno()
        if fd is None:
            return
        chunks = [(o, min(CHUNK, offset + n - o)) for o in range(offset, offset + n, CHUNK)]
        self.read += sum(self._pool.map(lambda c: _sendfile(fd, *c), chunks))


def _sendfile(fd: int, offset: int, n: int) -> int:
    """Reads file bytes ``[offset, offset + n)`` into the page cache (to /dev/null)."""
    done = 0
    with open(os.devnull, "wb") as sink:
        while done < n:
            sent = os.sendfile(sink.fileno(), fd, offset + done, n - done)
            if sent <= 0:
                break
            done += sent
    return done
