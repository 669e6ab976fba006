"""The ``threads=`` option shared by loads and saves."""

from __future__ import annotations

from fastload import _core
from fastload.core.basics.errors import RequestError

#: the most copy or write threads one call may use (more would only add scheduling and memory)
MAX_THREADS: int = _core.MAX_THREADS


def check_threads(threads: object, where: str = "") -> int | None:
    """``threads`` if it is ``None`` or an int in 1..MAX_THREADS, else ``RequestError``
    (prefixed with ``where``)."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        prefix = f"{where}: " if where else ""
        raise RequestError(
            f"{prefix}threads must be an int from 1 to {MAX_THREADS} or None, got {threads!r}"
        )
    return threads
