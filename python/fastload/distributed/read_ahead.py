"""The read-ahead of a collective read: this rank's chunks filled in order on a helper thread, a
few ahead of the exchange, into a fixed set of host buffers that the exchange gives back. A
subclass may let the fill of the next chunks start before the last one is done
(:attr:`ReadAhead.overlap`): a fill's parallel reads end one by one, and the threads the first
ones leave idle take up the next fill's, where one fill after the other left them waiting.

Where the bytes come from is the subclass's: positioned reads of a local file
(:class:`fastload.distributed.file_reads.FileReader`) or the engine's ranged GETs from object
storage (:class:`fastload.distributed.object_reads.ObjectReader`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ReadAhead"]


class ReadAhead:
    """Fills ``count`` chunks in order on a helper thread, at most ``depth`` ahead of
    :meth:`next`, each into one of ``depth`` host buffers of ``buffer_bytes``. A failure is
    handed to the exchange (:meth:`next` raises it), which tells the other ranks; leaving the
    ``with`` block stops the thread (and :meth:`_cancel` what it is doing)."""

    #: the helper thread's name
    thread_name = "fastload-read-ahead"
    #: fills that may run at once (each holds a buffer of the ``depth``), handed on in order;
    #: more than 1 only where the bytes stay on the CPU (a fill's result is what it hands on)
    overlap = 1

    def __init__(self, count: int, buffer_bytes: int, depth: int, device: torch.device) -> None:
        self.count = count
        self.device = device
        self.ready: queue.Queue[Any] = queue.Queue()  # what _fill returned, or its failure
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(min(depth, count)):
            self.free.put(torch.empty(buffer_bytes, dtype=torch.uint8))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def _fill(self, index: int, buffer: torch.Tensor, session: Any) -> Any:
        """Fills chunk ``index`` into ``buffer``; returns the view of ``buffer`` holding it (or,
        on the CPU, what else holds it: a subclass that puts the bytes elsewhere)."""
        raise NotImplementedError

    def _prepare(
        self, index: int, buffer: torch.Tensor, session: Any
    ) -> tuple[int, Callable[[], list[Any]]]:
        """The fill of chunk ``index`` (and, where a subclass joins them to it, the next ones)
        with ``buffer``: how many chunks it fills, and the call that fills them (it may run on
        another thread), returning what :meth:`_fill` returned for each, in order. Runs on the
        helper thread, in the chunks' order."""
        return 1, lambda: [self._fill(index, buffer, session)]

    def _session(self) -> contextlib.AbstractContextManager[Any]:
        """What the helper thread holds while it fills (a thread pool); none by default."""
        return contextlib.nullcontext()

    def _abandoned(self, error: BaseException) -> bool:
        """Whether ``error`` only says the read was called off (nobody waits for it)."""
        return False

    def _cancel(self) -> None:
        """Calls off a fill under way (when the exchange ends early)."""

    def _close(self) -> None:
        """Releases what the fills held, once the thread is done."""

    def __enter__(self) -> ReadAhead:
        if self.count:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._cancel()
        self.free.put(torch.empty(0, dtype=torch.uint8))  # wakes a reader waiting for a buffer
        if self.thread.is_alive():
            self.thread.join()
        self._close()

    def _run(self) -> None:
        try:
            with self._session() as session:
                if self.overlap > 1:
                    self._run_overlapped(session)
                    return
                index = 0
                while index < self.count:
                    buffer = self.free.get()
                    if self.stop.is_set():
                        return
                    count, fill = self._prepare(index, buffer, session)
                    for view in fill():
                        if self.device.type == "cpu":
                            self.ready.put(view)
                        else:  # NCCL exchanges device memory; the host buffer is free again
                            self.ready.put(view.to(self.device))
                            self.free.put(buffer)
                    index += count
        except BaseException as e:  # handed to the exchange, which tells the group
            self._failed(e)

    def _run_overlapped(self, session: Any) -> None:
        """As :meth:`_run`, with up to :attr:`overlap` fills running at once on threads of
        their own; each fill's chunks are handed on as soon as it and every fill before it are
        done (from the thread that ends the last of them), so the exchange never waits on this
        thread, which may be waiting for a buffer the exchange has yet to give back."""
        lock = threading.Lock()
        running: deque[Future[list[Any]]] = deque()
        ended = threading.Event()  # a fill failed or was called off: nothing more is handed on

        def hand_on(_: Future[list[Any]]) -> None:
            with lock:
                while running and running[0].done() and not ended.is_set():
                    done = running.popleft()
                    error = None if done.cancelled() else done.exception()
                    if done.cancelled() or error is not None:
                        ended.set()  # the exchange stops at the failure
                        if error is not None:
                            self._failed(error)
                    else:
                        for view in done.result():
                            self.ready.put(view)

        fills = ThreadPoolExecutor(self.overlap, thread_name_prefix=self.thread_name)
        try:
            index = 0
            while index < self.count and not ended.is_set():
                buffer = self.free.get()
                if self.stop.is_set() or ended.is_set():
                    return
                count, fill = self._prepare(index, buffer, session)
                future = fills.submit(fill)
                with lock:
                    running.append(future)
                future.add_done_callback(hand_on)
                index += count
        finally:  # the fills not begun are dropped; those under way end (a cancel stops them)
            fills.shutdown(wait=True, cancel_futures=self.stop.is_set() or ended.is_set())

    def _failed(self, error: BaseException) -> None:
        """Hands ``error`` to the exchange, unless it only says the read was called off."""
        if not self._abandoned(error):
            self.ready.put(error)

    def next(self) -> Any:
        """The next chunk's bytes (on the group's device), as :meth:`_fill` returned them;
        raises what its fill raised."""
        got = self.ready.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def release(self, buffer: torch.Tensor) -> None:
        """Gives the host buffer under ``buffer`` (a chunk handed out by :meth:`next`) back."""
        if buffer.device.type == "cpu":
            self.free.put(torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage()))
