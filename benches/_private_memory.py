"""Private memory of child processes, sampled from outside them.

A process's peak resident memory (``VmHWM``) counts the pages of the shared libraries' code it
ran, which stay in the page cache, are shared with every process that maps the same file and
are dropped under pressure without being written anywhere. A load touches 9-12 MiB of such
pages (libtorch's code for the operations it runs for the first time, the extension's object
storage client) whatever the checkpoint's size, and a single-process load touches most of the
same. The memory a load holds is the anonymous part (``RssAnon``: its tensors, buffers, Python
objects, freed heap still resident): :class:`PrivateMemoryWatch` samples it from the parent, in
``/proc/<pid>/statm`` (resident minus file-backed and shared pages), every few milliseconds.
Sampled, a peak shorter than the interval can be missed; a load's private peak is its end (its
tensors all filled), which the samples see.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

PAGE = os.sysconf("SC_PAGE_SIZE")


def private_bytes(pid: int | str = "self") -> int:
    """Resident anonymous bytes of process ``pid`` now (the kernel's ``statm``: resident pages
    less file-backed and shared ones); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            fields = f.read().split()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return (int(fields[1]) - int(fields[2])) * PAGE


class PrivateMemoryWatch:
    """Samples the private memory of ``pids`` every ``every`` seconds on a thread, with the
    time (``time.monotonic``: the same clock in every process of the machine) of each sample."""

    def __init__(self, pids: Iterable[int], every: float = 0.005) -> None:
        self.samples: dict[int, list[tuple[float, int]]] = {pid: [] for pid in pids}
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="private-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for pid, samples in self.samples.items():
                samples.append((now, private_bytes(pid)))
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, pid: int, start: float, stop: float) -> int:
        """The most private memory ``pid`` had in a sample from ``start`` to ``stop``
        (``time.monotonic`` times); 0 without a sample then."""
        return max((v for t, v in self.samples[pid] if start <= t <= stop), default=0)


__all__ = ["PrivateMemoryWatch", "private_bytes"]
