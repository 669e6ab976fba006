"""What every load runs under: a clock of its phases, Python's cyclic garbage collector paused,
and torch's factory functions allocating on the CPU unless told otherwise
(:func:`fastload.core.loading.load` wears both decorators)."""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from fastload.core.devices.checks import cpu_by_default

__all__ = ["Clock", "device_explicit", "without_gc_pauses"]


class Clock:
    """The seconds each phase of a load took, by name (summed when a phase recurs)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


_F = TypeVar("_F", bound=Callable[..., Any])
_gc_lock = threading.Lock()
_gc_paused = 0  # loads under way that paused the cyclic garbage collector
_gc_was_enabled = False


def without_gc_pauses(fn: _F) -> _F:
    """Runs ``fn`` with Python's cyclic garbage collector paused (reference counting still frees
    memory), restored when the last concurrent load ends.

    A load creates thousands of objects that all survive (modules, parameters, plan records), which
    is what makes the collector run: a full collection walks every object of the process, and with
    torch and a large model library imported one took 265-295 ms in the middle of a 0.3 s load of 4
    GiB here (measured with ``gc.callbacks``). Cycles made meanwhile are collected afterwards."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        global _gc_paused, _gc_was_enabled
        with _gc_lock:
            if _gc_paused == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _gc_lock:
                _gc_paused -= 1
                if _gc_paused == 0 and _gc_was_enabled:
                    gc.enable()

    return paused  # type: ignore[return-value]


def device_explicit(fn: _F) -> _F:
    """Runs ``fn`` with torch's factory functions allocating on the CPU unless told otherwise.

    The load's devices are its arguments (``device``, ``device_map``): an ambient device context
    of the caller (``with torch.device("meta")``, ``torch.set_default_device("cuda")``) must not
    leak into the skeleton's buffers, the family's finishing code or any temporary, as it would
    put tensors on a device nobody asked for (a meta buffer in a loaded model, a CPU mapping
    viewed as a meta tensor). fastload's own allocations name their device as well."""

    @functools.wraps(fn)
    def explicit(*args: Any, **kwargs: Any) -> Any:
        with cpu_by_default():
            return fn(*args, **kwargs)

    return explicit  # type: ignore[return-value]
