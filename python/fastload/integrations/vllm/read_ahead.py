"""Working ahead of vLLM's weight loaders, for :class:`~.weights.CheckpointWeights`: the helper
threads that read the mapped files into the page cache (parallel ``sendfile`` to /dev/null, paced
to stay within the memory budget's read-ahead room, :mod:`fastload.core.memory.budget`) and that
make the copy path's private copies (at most :data:`COPY_AHEAD` bytes ahead), stopping them; the
files they work on (:class:`_File`) and the ``madvise`` of a tensor-parallel rank's mapping.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import to_torch, torch_shape
from fastload.core.basics.engine import copy_into
from fastload.core.memory.budget import memory_budget
from fastload.core.memory.sharing import WARM_PIECE, SharedMapping
from fastload.core.memory.staging import StagingPool

from .options import VllmLoadOptions

_MADV_RANDOM = 1
_PAGE = os.sysconf("SC_PAGE_SIZE")
#: threads reading ahead into the page cache (requests in flight for the disk), unless the
#: ``threads`` option says otherwise
READ_THREADS = 8
#: bytes of copies made ahead of the weight loaders at most (copy path)
COPY_AHEAD = 256 << 20


@dataclass
class _File:
    path: str
    st: _core.SafetensorsFile | None  # None: a pickle file
    mapping: SharedMapping | None = None
    # (name, st_dtype, shape, begin, end) in file order
    entries: list[tuple[str, str, list[int], int, int]] | None = None


class ReadAhead:
    """The helper threads of a :class:`~.weights.CheckpointWeights`, which sets up the attributes
    below."""

    options: VllmLoadOptions
    tp_size: int
    staged: bool
    _files: list[_File]
    _pool: StagingPool | None
    _consumed: int
    _wake: threading.Condition
    _stop: bool
    _reader: threading.Thread | None

    # -- reading ahead ---------------------------------------------------------------------------

    def _start_reader(self) -> None:
        """The helper thread that reads the mapped files into the page cache ahead of the weight
        loaders (one rank: every byte is needed), where they are not cached yet, on several
        threads (the disk's queue kept full), paced to stay within the memory budget's read-ahead
        room. Only into the page cache: the engine copies from there (positioned reads), and a
        view a parameter keeps maps its pages when it is first used, so the server maps no page
        it does not keep."""
        if not self.options.read_ahead or self.tp_size > 1 or self.staged:
            return
        pieces: list[tuple[_core.SafetensorsFile, int, int, int]] = []  # (file, start, stop, at)
        at = 0
        for f in self._files:
            if f.st is None:
                continue
            # the byte runs of the tensors handed out (all of the data, unless some are left out)
            for start, stop in _runs(f.entries or [], f.st.data_start):
                if f.mapping is not None:
                    cuts = [
                        start,
                        *range(start // WARM_PIECE * WARM_PIECE + WARM_PIECE, stop, WARM_PIECE),
                    ]
                    for a, b in zip(cuts, [*cuts[1:], stop], strict=True):
                        pieces.append((f.st, a, b, at + a - start))
                at += stop - start
        if not pieces:
            return
        room = memory_budget().read_ahead_room()
        threads = self.options.threads or READ_THREADS

        def run() -> None:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                with ThreadPoolExecutor(threads, thread_name_prefix="fastload-vllm-read") as pool:
                    for st, a, b, begin in pieces:
                        with self._wake:
                            while (
                                not self._stop
                                and room is not None
                                and begin - self._consumed > room
                            ):
                                self._wake.wait(0.5)
                            if self._stop:
                                return
                        fd = st.fileno()
                        if fd is None or not st.mostly_uncached(a, b - a):
                            continue
                        step = -(-(b - a) // threads // _PAGE) * _PAGE
                        starts = range(a, b, step)
                        stops = [min(c + step, b) for c in starts]
                        n = len(starts)
                        list(pool.map(_read_through, [fd] * n, [null] * n, starts, stops))
            except OSError:
                pass  # the engine's and the faults' own reads then report the file
            finally:
                os.close(null)

        self._reader = threading.Thread(target=run, name="fastload-vllm-read-ahead", daemon=True)
        self._reader.start()

    def close(self) -> None:
        """Stops the helper threads (a load that failed part way leaves them nothing to do)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        if self._pool is not None:
            self._pool.release()

    # -- handing tensors out ---------------------------------------------------------------------

    def _copies(self, f: _File) -> Iterator[tuple[str, torch.Tensor]]:
        """Private copies of ``f``'s tensors, made by the engine on a helper thread ahead of the
        consumer (at most :data:`COPY_AHEAD` bytes, or the budget's room if less)."""
        assert f.st is not None and f.entries is not None
        st, entries = f.st, f.entries
        room = memory_budget().read_ahead_room()
        ahead = COPY_AHEAD if room is None else max(1, min(COPY_AHEAD, room))
        q: queue.Queue[Any] = queue.Queue()
        credit = threading.Semaphore(0)
        state = {"held": 0}
        lock = threading.Lock()

        def produce() -> None:
            try:
                for name, st_dtype, shape, begin, end in entries:
                    while True:
                        with lock:
                            if self._stop:
                                return
                            if state["held"] == 0 or state["held"] + end - begin <= ahead:
                                state["held"] += end - begin
                                break
                        credit.acquire(timeout=0.5)
                    where = f"{f.path}: tensor {name!r}"
                    dest = torch.empty(
                        torch_shape(st_dtype, shape, where=where),
                        dtype=to_torch(st_dtype),
                        device="cpu",
                    )
                    if dest.numel():
                        copy_into(st, [(name, dest, st_dtype, None)], self.options.threads)
                    q.put((name, dest, end - begin))
                q.put(None)
            except BaseException as e:  # handed to the consumer, which raises it
                q.put(e)

        worker = threading.Thread(target=produce, name="fastload-vllm-copy", daemon=True)
        worker.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                name, tensor, nbytes = item
                with lock:
                    state["held"] -= nbytes
                credit.release()
                yield name, tensor
        finally:
            with lock:
                self._stop = True
            worker.join()
            self._stop = False


def _runs(entries: list[tuple[str, str, list[int], int, int]], base: int) -> list[tuple[int, int]]:
    """The file byte runs ``[start, stop)`` the entries (offsets from the data section at
    ``base``, in file order) occupy, touching ones merged."""
    runs: list[tuple[int, int]] = []
    for e in entries:
        if runs and runs[-1][1] == base + e[3]:
            runs[-1] = (runs[-1][0], base + e[4])
        elif e[4] > e[3]:
            runs.append((base + e[3], base + e[4]))
    return runs


def _read_through(fd: int, null: int, start: int, stop: int) -> None:
    """Reads file bytes ``[start, stop)`` into the page cache without copying them anywhere
    (``sendfile`` to /dev/null; the GIL is released meanwhile)."""
    while start < stop:
        sent = os.sendfile(null, fd, start, stop - start)
        if sent <= 0:
            return
        start += sent


def _madvise(address: int, length: int, advice: int) -> None:
    """``madvise`` on a mapping fastload made (advisory: a failure changes speed, not data)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = address // page * page
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start), advice)
