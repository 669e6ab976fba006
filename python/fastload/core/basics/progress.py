"""The load progress bar: advanced per copied piece from the copy engine's byte counter.

The Rust engine counts the bytes it has written in a :class:`fastload._core.Progress` (one piece of
at most ``_core.CHUNK`` bytes at a time) and calls the counter's callback every few tens of
milliseconds while it copies, so a single large file moves the bar as it loads instead of jumping
at its end. Bars are off when ``progress=False``, or when any of ``FASTLOAD_DISABLE_PROGRESS_BARS``,
``HF_HUB_DISABLE_PROGRESS_BARS`` or ``TQDM_DISABLE`` is set to a true value (``1``, ``true``,
``yes``, ``on``). Sizes are shown in binary units, labelled as such (MiB, GiB).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastload import _core

#: loads above this size show a progress bar even when stderr is not a terminal
PROGRESS_MIN_BYTES = 64 << 20

#: environment variables that turn progress bars off (fastload's own, the hub client's, tqdm's)
DISABLE_VARS = ("FASTLOAD_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")


def _true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in {"1", "true", "yes", "on"}


def bar_wanted(total: int, enabled: bool) -> bool:
    """Whether a load of ``total`` bytes shows a bar: asked for, not turned off by the
    environment, and either large or on a terminal."""
    if not enabled or any(_true(os.environ.get(var)) for var in DISABLE_VARS):
        return False
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return total > PROGRESS_MIN_BYTES or tty


def binary_unit(total: int) -> tuple[str, int]:
    """The binary unit a bar over ``total`` bytes counts in, and its size in bytes."""
    for name, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if total >= size:
            return name, size
    return "KiB", 1 << 10


@contextmanager
def byte_progress(total: int, enabled: bool, desc: str = "fastload") -> Iterator[_core.Progress]:
    """A copy-engine counter for a load of ``total`` destination bytes, drawing a tqdm bar when
    :func:`bar_wanted` says so. Pass the counter to every copy of the load."""
    if not bar_wanted(total, enabled):
        yield _core.Progress()
        return
    bar = open_bar(total, desc)
    size = bar.fastload_unit

    def advance(done: int) -> None:
        bar.update(done / size - bar.n)

    counter = _core.Progress(advance)
    with bar:
        yield counter
        advance(counter.done)


def open_bar(total: int, desc: str = "fastload") -> Any:
    """A tqdm bar over ``total`` bytes, counting in a binary unit (its size in bytes is the bar's
    ``fastload_unit``): advance it by ``nbytes / bar.fastload_unit``."""
    from tqdm.auto import tqdm

    unit, size = binary_unit(total)
    # tqdm's own unit_scale labels powers of 1024 "MB" and its rate in powers of 1000: the bar
    # counts in the binary unit itself instead.
    bar: Any = tqdm(
        total=total / size,
        unit=unit,
        desc=desc,
        file=sys.stderr,
        bar_format="{l_bar}{bar}| {n:.2f}/{total:.2f} "
        + unit
        + " [{elapsed}<{remaining}, {rate_fmt}]",
    )
    bar.fastload_unit = size
    return bar
