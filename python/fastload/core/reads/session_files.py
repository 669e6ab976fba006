"""One file a :class:`~fastload.core.reads.session.LoadSession` reads ahead, and how.

The session's helper thread reads each file before its load needs it. What it does with the file
depends on what the file's load makes of it:

* **views** (the CPU, the stored dtype): the file is read and mapped in one pass, in the helper
  thread, off the loads' path (a file mostly not cached by parallel threads as one piece, a cached
  one in :data:`~fastload.core.memory.sharing.WARM_PIECE` pieces that the load helps map once it
  joins), so the load's views find their pages mapped;
* **copies** (a dtype conversion): the file is read into the page cache only
  (:meth:`~fastload._core.SafetensorsFile.read_through`: parallel ``sendfile`` to /dev/null), and
  the load copies from there, holding no mapping of its file beside its new tensors;
* **not known yet**: read into the page cache only; mapped by its load when it joins, if the load
  makes views.

The caller of the session says what it knows (``views`` of :class:`AheadFile`); each load says it
when it opens its checkpoint (:meth:`~fastload.core.reads.session.SessionPart.warm`), which
decides for the files the helper has not reached yet.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from fastload import _core
from fastload.core.basics.errors import FastloadError
from fastload.core.memory.sharing import WARM_PIECE, SharedMapping

__all__ = ["AheadFile", "read_into_cache"]

#: bytes per read-through call: the helper thread looks at the session's stop between calls
_STEP = 256 << 20
#: parallel readers of the read-through (the disk serves parallel requests best)
_THREADS = 8


def read_into_cache(file: _core.SafetensorsFile, stop: threading.Event) -> None:
    """Reads ``file``'s tensor data into the page cache, mapping nothing (the read path caches
    large folios, which a later mapping maps fast); stops early once ``stop`` is set."""
    for offset in range(file.data_start, file.file_size, _STEP):
        if stop.is_set():
            return
        file.read_through(offset, _STEP, threads=_THREADS)


class AheadFile:
    """One file the session reads ahead: its mapping, the read's state, and whether its load makes
    views of it (``views``: ``True``, ``False``, or ``None`` while not known)."""

    def __init__(self, mapping: SharedMapping, views: bool | None = None) -> None:
        self.mapping = mapping
        self.nbytes = mapping.file.file_size - mapping.file.data_start
        #: whether the file's load makes views of it; the helper maps it as it reads it if so
        self.views = views
        self._lock = threading.Lock()
        self._pieces: list[tuple[int, int, bool]] | None = None
        self._claims = itertools.count()
        self._done = 0
        self._finished = threading.Condition(self._lock)
        self.error: FastloadError | None = None
        self.mapped = 0
        #: set once the helper has reached the file (read it, or started mapping it)
        self.read = threading.Event()
        self.was_cold = False

    def _list(self) -> list[tuple[int, int, bool]]:
        with self._lock:
            if self._pieces is None:
                file = self.mapping.file
                start, stop = file.data_start, file.file_size
                if self.was_cold or file.mostly_uncached():
                    self._pieces = [(start, stop, True)]
                else:
                    cuts = [
                        start,
                        *range(start // WARM_PIECE * WARM_PIECE + WARM_PIECE, stop, WARM_PIECE),
                    ]
                    ends = [*cuts[1:], stop]
                    self._pieces = [(a, b, False) for a, b in zip(cuts, ends, strict=True)]
            return self._pieces

    def work(self, advance: Callable[[int], None], stop: threading.Event | None = None) -> None:
        """Claims and maps pieces of the file until none is left (or ``stop`` is set)."""
        pieces = self._list()
        for i in self._claims:
            if i >= len(pieces) or (stop is not None and stop.is_set()):
                return
            start, end, cold = pieces[i]
            try:
                if self.error is None:
                    n = self.mapping.map_all() if cold else self.mapping.map_span(start, end)
                    self.mapped += n
                    advance(end - start)
            except FastloadError as e:
                self.error = e
            finally:
                with self._lock:
                    self._done += 1
                    self._finished.notify_all()

    def run(self, advance: Callable[[int], None], stop: threading.Event) -> None:
        """The helper thread's turn at the file: read and map it where its load makes views,
        else read it into the page cache if it is mostly not there."""
        if self.views:
            self.read.set()  # its load, once it joins, helps map the pieces left
            self.work(advance, stop)
            return
        try:
            file = self.mapping.file
            if file.mostly_uncached():
                self.was_cold = True  # mapped, if at all, by parallel threads as one piece
                read_into_cache(file, stop)
            advance(self.nbytes)
        except OSError:
            pass  # the load reads the file itself, and reports what is wrong with it
        finally:
            self.read.set()

    def wait(self, advance: Callable[[int], None]) -> None:
        """Waits for the helper to reach the file, maps the pieces left (with the helper where it
        maps them too), and raises what went wrong."""
        self.read.wait()
        self.work(advance)
        pieces = self._list()
        with self._lock:
            self._finished.wait_for(lambda: self._done >= len(pieces))
        if self.error is not None:
            raise self.error
