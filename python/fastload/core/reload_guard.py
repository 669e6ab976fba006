"""What keeps a reload from leaving a model half old, half new without saying so.

- :func:`check_staging_memory`: ``atomic=True`` is refused before it reads when its staged copies
  do not fit (the memory budget of :mod:`fastload.core.memory` for the CPU's, an accelerator's
  free memory for its);
- :func:`sigint_deferred`: the commit of staged tensors is not cut by a Ctrl-C;
- :func:`fail`: a failure after the first write into the model marks it (its forward refuses to
  run, :func:`mark`) and names the tensors that may hold new bytes, until :func:`unmark`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn

from fastload.core.errors import MemoryBudgetError, ReloadError
from fastload.core.keys import format_names
from fastload.core.memory import memory_budget
from fastload.core.redaction import add_note, redact
from fastload.core.reload_record import LoadRecord
from fastload.core.units import format_bytes

__all__ = ["check_staging_memory", "sigint_deferred", "fail", "mark", "unmark"]


def check_staging_memory(need: Mapping[torch.device, int], label: str) -> None:
    """Raises ``MemoryBudgetError`` when ``need`` (bytes to stage per device) does not fit."""
    for device, nbytes in need.items():
        if device.type == "cpu":
            budget = memory_budget()
            free, where = budget.available, budget.describe()
            room = None if free is None else free + budget.swap
        elif device.type == "cuda":
            room = free = torch.cuda.mem_get_info(device)[0]
            where = f"free on {device}"
        else:  # no figure to check against
            continue
        if room is not None and nbytes > room:
            raise MemoryBudgetError(
                f"{label}: reload(atomic=True) stages {format_bytes(nbytes)} ({nbytes} bytes) on "
                f"{device} before committing, but only {format_bytes(free or 0)} is available "
                f"({where}). Refused before reading; the model is unchanged. Reload without "
                "atomic=True (a failure then names the tensors written), or free memory",
                nbytes,
            )


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Holds a Ctrl-C back until the block is done, then delivers it to the handler it would
    have reached (Python's: ``KeyboardInterrupt``; ignored; the default: the process ends). Only
    the main thread can hold it, and only a handler set from Python can be put back."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def fail(
    model: nn.Module, record: LoadRecord, names: Sequence[str], exc: BaseException, doing: str
) -> NoReturn:
    """Marks ``model`` torn (``names`` hold new or partly new bytes) and raises: a
    ``ReloadError`` for an error, the interrupt itself (with a note) for a ``KeyboardInterrupt``
    or ``SystemExit``."""
    torn = sorted(set(names) | set(record.torn[1] if record.torn else []))
    message = redact(
        f"fastload.reload failed while {doing}: {len(torn)} tensors hold new or partly new "
        f"bytes, the others their old ones: {format_names(torn)}. The model refuses to run "
        "until a reload succeeds"
    )
    mark(model, record, torn, message)
    if isinstance(exc, Exception):
        raise ReloadError(f"{message} ({type(exc).__name__}: {exc})", torn) from exc
    add_note(exc, message)  # a KeyboardInterrupt is not a FastloadError, which would redact it
    raise exc


def mark(model: nn.Module, record: LoadRecord, names: list[str], message: str) -> None:
    """The model's forward raises ``ReloadError`` until :func:`unmark`; the digests of what may
    have changed no longer describe the model's bytes, so no later reload skips them."""
    for entry in record.entries:
        if entry.name in names:
            for part in entry.parts:
                record.digests.pop(part.stored, None)

    def refuse(module: nn.Module, args: Any) -> None:
        raise ReloadError(message, names)

    if record.torn is not None:
        record.torn[0].remove()
    record.torn = (model.register_forward_pre_hook(refuse), names)


def unmark(record: LoadRecord) -> None:
    """Lets the model run again (a reload succeeded)."""
    if record.torn is not None:
        record.torn[0].remove()
        record.torn = None
