"""Fetches from object storage made behind vLLM's weight loaders, straight into the parameters.

A weight loader's ``param.data.copy_(loaded_weight)`` of a tensor handed out unread
(:mod:`.remote_slices`) does not wait for the bytes: the copy is queued here (the file, the
tensor, the slice it takes, the destination) and returns at once, and a helper thread fetches
what is queued with the engine's ranged GETs, in parallel across tensors and shards, straight
into the destinations, while the weight loaders go on queueing. The load so needs no memory beside
the model and makes no copy of its own, and the fetches run as one stream at the transport's
pace instead of one tensor at a time (measured under vLLM: one tensor at a time took 2x the
ranged-GET floor).

No code sees a destination before its bytes are in: anything other than a queued copy that
touches bytes a fetch queued or running writes (reads them, writes them, converts them) waits
for every queued fetch first (:meth:`Fetches.wait_for`; other bytes of the same tensor wait for
nothing); a queued copy into bytes that
overlap a queued one waits too, so two writes to the same bytes land in the order they were made.
The end of the load waits for all of them (:meth:`Fetches.drain`), and a fetch that failed raises
its error there, or at the next copy queued, naming the file and the tensor.

A one-rank load from local files queues the engine's copies the same way
(:class:`~.adopt.CopyWatch` with ``defer``): made in batches behind the weight loaders instead of
one engine call per tensor on their thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.progress import bar_wanted, binary_unit
from fastload.core.reads.reading import FillItem, fill_many
from fastload.safetensors.preparing import byte_span

#: the bytes of queued fetches one engine call takes at most while the weight loaders are still
#: queueing (what is queued, up to this), so that fetches start behind them. Once the load waits
#: for the queue (:meth:`Fetches.drain`: its end, or a read of bytes not yet fetched), all that is
#: queued goes in one more call, started at once beside those under way. The helper threads'
#: calls share the engine's pool and end together: takes of 256 MiB to the end of the queue let
#: the pool run short of requests at every take's tail and left a last small take alone (vLLM's
#: 1.1 GiB benchmark model, the server's files evicted: 3.85 s against 3.39 s with one call for
#: the rest, 4 of 4 runs, the ranged-GET floor 2.97 s; that call started at once, not after the
#: takes under way: 3.43 s against 3.76 s, floor 3.06 s)
TAKE_BYTES = 256 << 20
#: helper threads making the queued fetches
WORKERS = 2


class FetchProgress:
    """The progress bar of a load whose tensors are handed out unread: the bytes fetched against
    the bytes asked for (:meth:`ask`, as the weight loaders' copies queue or make their fetches).
    What a tensor-parallel rank fetches is known only as its weight loaders copy (their slices, a
    norm whole), so the total grows while they walk the checkpoint (quickly: nothing waits for
    bytes then), and the bar then fills as the fetches land, to 100 % of this rank's share:
    ``fastload: loading weights (rank 0 fetches its slices): 100%|...| 0.55/0.55 GiB``. (A bar of
    the bytes fetched against the checkpoint would stop near 1/N of the way on N ranks: a load
    that reads as cut short.) ``checkpoint``: the bytes handed out, which decide whether a bar is
    drawn (:func:`~fastload.core.basics.progress.bar_wanted`); ``expected``: the bytes expected to
    be fetched (the checkpoint's on one rank, 1/N of it on N), the bar's first total and unit;
    ``rank``: this process's rank, named under tensor parallelism (``slices``)."""

    def __init__(
        self,
        checkpoint: int,
        expected: int,
        enabled: bool,
        *,
        slices: bool = False,
        rank: int | None = None,
    ) -> None:
        self._unit, self._size = binary_unit(expected)
        self.asked = 0
        self._bar: Any = None
        if bar_wanted(checkpoint, enabled):
            from tqdm.auto import tqdm

            who = "this rank" if rank is None else f"rank {rank}"
            desc = "fastload: loading weights" + (f" ({who} fetches its slices)" if slices else "")
            self._bar = tqdm(
                total=expected / self._size,
                unit=self._unit,
                desc=desc,
                file=sys.stderr,
                bar_format="{l_bar}{bar}| {n:.2f}/{total:.2f} "
                + self._unit
                + " [{elapsed}<{remaining}, {rate_fmt}]",
            )
        #: the engine's count of the bytes fetched: every fetch of the load is given it
        self.counter = _core.Progress(None if self._bar is None else self._advance)

    def _advance(self, done: int) -> None:
        self._bar.update(done / self._size - self._bar.n)

    def ask(self, nbytes: int) -> None:
        """A fetch of ``nbytes`` was queued or is being made."""
        self.asked += nbytes
        if self._bar is not None and self.asked / self._size > self._bar.total:
            self._bar.total = self.asked / self._size

    def close(self) -> None:
        """Ends the bar at what was fetched, against what was asked for."""
        if self._bar is not None:
            self._bar.total = max(self.asked, self.counter.done) / self._size
            self._advance(self.counter.done)
            self._bar.close()


def this_rank() -> int | None:
    """This process's rank in ``torch.distributed`` (``None``: no process group)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


@dataclass
class _Fetch:
    file: _core.SafetensorsFile
    name: str
    dst: torch.Tensor  # kept alive until written
    selection: list[int] | None
    span: tuple[int, int, int]  # storage address, first byte, end

    @property
    def nbytes(self) -> int:
        return self.span[2] - self.span[1]


def _extent(t: torch.Tensor) -> tuple[int, int, int] | None:
    """The bytes a CPU tensor's elements lie in: (storage address, first byte, end), every byte
    between its lowest and highest element (a strided view's gaps included); ``None``: no element
    in CPU memory."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), *byte_span(t))


class Fetches:
    """The fetches queued by one load's weight loaders, made by a helper thread (module
    docstring). ``threads``: the engine's threads."""

    def __init__(
        self,
        threads: int | None = None,
        take_bytes: int | None = None,
        *,
        defer: bool = True,
        ahead: int | None = None,
    ) -> None:
        self.threads = threads
        #: bytes queued and not yet made at most (``None``: no bound); a submit beyond it waits.
        #: Copies from local files read what the read-ahead put in the page cache: a queue far
        #: behind the weight loaders would let it be dropped before they are made
        self.ahead = ahead
        #: whether the weight loaders' copies queue their fetches here; ``False``: each is made
        #: as it is copied (a reload, whose recovery takes a copy that returned for a layer filled)
        self.defer = defer
        self.take_bytes = TAKE_BYTES if take_bytes is None else take_bytes
        #: helper threads making fetches at once (one's engine call ends with few requests in
        #: flight, its last GETs; another's fills the gap)
        self.workers = WORKERS
        #: the load's bar, given every fetch's bytes (set by the stream that draws it)
        self.progress: FetchProgress | None = None
        self._cond = threading.Condition()
        self._queue: list[_Fetch] = []
        #: storage address -> spans (first byte, end) queued or being written
        self._pending: dict[int, list[tuple[int, int]]] = {}
        self._error: BaseException | None = None
        #: the helper threads making fetches, and those that ended (joined by the next wait)
        self._workers: set[threading.Thread] = set()
        self._ended: list[threading.Thread] = []
        self._stopped = False
        #: drains waiting: a take is then everything queued (:data:`TAKE_BYTES`)
        self._draining = 0

    def submit(
        self,
        file: _core.SafetensorsFile,
        name: str,
        dst: torch.Tensor,
        selection: list[int] | None,
    ) -> None:
        """Queues the fetch of tensor ``name`` of ``file`` (``selection``: the slice, ``None``:
        all of it) into ``dst``, a contiguous CPU tensor of its stored shape, of its stored dtype
        or one the engine converts it to (F32, F16, BF16, F64). Raises the error of a fetch that
        failed since the last wait."""
        storage = dst.untyped_storage().data_ptr()
        first = dst.data_ptr()
        fetch = _Fetch(file, name, dst, selection, (storage, first, first + dst.nbytes))
        self.ask(fetch.nbytes)
        with self._cond:
            self._raise_failure()
            while self._overlaps(fetch.span) or self._behind(fetch.nbytes):
                self._cond.wait()  # an earlier write to these bytes lands first
                self._raise_failure()
            self._queue.append(fetch)
            self._pending.setdefault(storage, []).append(fetch.span[1:])
            self._stopped = False
            self._start_worker()
            self._cond.notify_all()

    def _start_worker(self) -> None:
        """Starts a helper thread unless :attr:`workers` run (one more while a drain waits)."""
        if len(self._workers) < self.workers + (1 if self._draining else 0):
            worker = threading.Thread(target=self._run, name="fastload-remote-fetches", daemon=True)
            self._workers.add(worker)
            worker.start()

    @property
    def counter(self) -> _core.Progress | None:
        """The engine's counter of the bytes fetched (the bar's), if any."""
        return self.progress.counter if self.progress is not None else None

    def ask(self, nbytes: int) -> None:
        """Counts a fetch of ``nbytes`` in the bar's total (queued here, or made elsewhere)."""
        if self.progress is not None:
            self.progress.ask(nbytes)

    def pending(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` (CPU tensors) spans bytes of a fetch not yet made. Bytes,
        not storages: vLLM's vocabulary weight loader zeroes the padding rows of the embedding
        right after queueing the copy into the rows above them, and waiting there for the whole
        queue held the weight loaders up for 0.1-0.15 s per embedding (measured under vLLM)."""
        if not self._pending:
            return False
        with self._cond:  # every torch call of the load asks: extents only on a pending storage
            return any(
                (span := _extent(t)) is not None and self._overlaps(span)
                for t in tensors
                if t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._pending
            )

    def wait_for(self, tensors: Iterable[torch.Tensor]) -> None:
        """Waits for every queued fetch when any of ``tensors`` spans bytes of one queued or
        running."""
        if self.pending(tensors):
            self.drain()

    def drain(self) -> None:
        """Waits until every queued fetch is made; raises the error of one that failed."""
        with self._cond:
            self._draining += 1
            if self._queue:  # the rest starts now, beside the takes under way
                self._start_worker()
            try:
                while self._workers:  # they end once nothing is queued
                    self._cond.wait()
            finally:
                self._draining -= 1
            ended, self._ended = self._ended, []
        # joined before returning: a process that ends right after its load must not find the
        # worker still letting go of its tensors (torch aborts at exit under a live thread)
        for thread in ended:
            thread.join()
        with self._cond:
            self._raise_failure()

    def stop(self) -> None:
        """Ends the queue of a load given up: drops the fetches not started and, where the load
        draws a bar (every load from object storage: its counter's flag), cancels those being
        made (the engine abandons their requests in flight instead of finishing a take of up
        to :data:`TAKE_BYTES` from a slow store), then waits for the helper threads."""
        with self._cond:
            self._stopped = True
            self._drop_queue()
            if self._workers and self.counter is not None:
                self.counter.cancel()
            self._cond.notify_all()
            threads = [*self._workers, *self._ended]
            self._ended = []
        for thread in threads:
            thread.join()

    def _raise_failure(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _behind(self, nbytes: int) -> bool:
        """Whether queueing ``nbytes`` more would pass :attr:`ahead` (one fetch always may)."""
        if self.ahead is None:
            return False
        outstanding = sum(end - first for spans in self._pending.values() for first, end in spans)
        return 0 < outstanding and outstanding + nbytes > self.ahead

    def _release(self, fetch: _Fetch) -> None:
        storage, first, end = fetch.span
        spans = self._pending[storage]
        spans.remove((first, end))
        if not spans:
            del self._pending[storage]

    def _drop_queue(self) -> None:
        for f in self._queue:
            self._release(f)
        self._queue.clear()

    def _overlaps(self, span: tuple[int, int, int]) -> bool:
        storage, first, end = span
        return any(a < end and first < b for a, b in self._pending.get(storage, ()))

    def _take(self) -> list[_Fetch] | None:
        """The next fetches to make, or ``None`` (the worker ends; a later submit starts one)."""
        with self._cond:
            if not self._queue or self._stopped:
                worker = threading.current_thread()
                self._workers.discard(worker)
                self._ended.append(worker)
                self._cond.notify_all()
                return None
            limit = None if self._draining else self.take_bytes
            taken, size = [], 0
            while self._queue and (
                not taken or limit is None or size + self._queue[0].nbytes <= limit
            ):
                taken.append(self._queue.pop(0))
                size += taken[-1].nbytes
            return taken

    def _run(self) -> None:
        while (taken := self._take()) is not None:
            work: dict[int, tuple[_core.SafetensorsFile, list[FillItem]]] = {}
            for f in taken:
                work.setdefault(id(f.file), (f.file, []))[1].append((f.name, f.dst, f.selection))
            error: BaseException | None = None
            try:
                fill_many(list(work.values()), self.threads, None, self.counter)
            except BaseException as e:  # raised to the weight loaders' thread
                error = e
            with self._cond:
                for f in taken:
                    self._release(f)
                if self._stopped:  # cancelled by stop: nobody waits for this load any more
                    error = None
                if error is not None:
                    self._error = self._error or error
                    self._drop_queue()  # the load failed: what is left is not made
                self._cond.notify_all()
            del taken, work


__all__ = ["FetchProgress", "Fetches", "this_rank"]
