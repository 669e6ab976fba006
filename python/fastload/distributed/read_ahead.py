"""The read-ahead of a collective read: this rank's chunks filled in order on a helper thread, a
few ahead of the exchange, into a fixed set of host buffers that the exchange gives back.

Where the bytes come from is the subclass's: positioned reads of a local file
(:class:`fastload.distributed.file_reads.FileReader`) or the engine's ranged GETs from object
storage (:class:`fastload.distributed.object_reads.ObjectReader`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
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

    def _fills(self, index: int, buffer: torch.Tensor, session: Any) -> list[Any]:
        """Fills chunk ``index`` (and, where a subclass joins them to it, the next ones) with
        ``buffer``; what :meth:`_fill` returned for each, in order."""
        return [self._fill(index, buffer, session)]

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
                index = 0
                while index < self.count:
                    buffer = self.free.get()
                    if self.stop.is_set():
                        return
                    filled = self._fills(index, buffer, session)
                    for view in filled:
                        if self.device.type == "cpu":
                            self.ready.put(view)
                        else:  # NCCL exchanges device memory; the host buffer is free again
                            self.ready.put(view.to(self.device))
                            self.free.put(buffer)
                    index += len(filled)
        except BaseException as e:  # handed to the exchange, which tells the group
            if not self._abandoned(e):
                self.ready.put(e)

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
