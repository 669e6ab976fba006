"""What keeps a reload from leaving a model half old, half new without saying so.

- :func:`check_staging_memory`: ``atomic=True`` is refused before it reads when its staged copies
  do not fit (the memory budget of :mod:`fastload.core.memory.budget` for the CPU's, with the pages
  its commit copies where the model's weights are copy-on-write views of their files; an
  accelerator's free memory for its);
- :func:`sigint_deferred`: the commit of staged tensors is not cut by a Ctrl-C;
- :func:`fail`: a failure after the first write into the model marks it (neither it nor any of
  its submodules runs, :func:`mark`) and names the tensors that may hold new bytes, until
  :func:`unmark`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch
from torch import nn

from fastload.core.basics.errors import MemoryBudgetError, ReloadError
from fastload.core.basics.redaction import add_note, redact
from fastload.core.basics.units import format_bytes
from fastload.core.memory.budget import copy_on_write_bytes, memory_budget
from fastload.core.model.keys import format_names
from fastload.reloading.record import LoadRecord

__all__ = ["check_staging_memory", "sigint_deferred", "fail", "mark", "unmark"]


def check_staging_memory(
    need: Mapping[torch.device, int], label: str, written: Sequence[torch.Tensor] = ()
) -> None:
    """Raises ``MemoryBudgetError`` when ``need`` (bytes to stage per device) does not fit, on
    the CPU with what the commit's writes into ``written`` (the model's tensors) cost besides:
    a tensor that is a copy-on-write view of its file (a load's view) copies each page on its
    first write (:func:`~fastload.core.memory.budget.copy_on_write_bytes`)."""
    for device, staged in need.items():
        cow = 0
        if device.type == "cpu":
            budget = memory_budget()
            free, where = budget.available, budget.describe()
            room = None if free is None else free + budget.swap
            if room is not None:
                cow = copy_on_write_bytes(_span(t) for t in written if t.device.type == "cpu")
        elif device.type == "cuda":
            room = free = torch.cuda.mem_get_info(device)[0]
            where = f"free on {device}"
        else:  # no figure to check against
            continue
        nbytes = staged + cow
        if room is not None and nbytes > room:
            views = (
                f", and its commit writes into the model's weights that are copy-on-write views "
                f"of their files, which copies {format_bytes(cow)} of their pages"
                if cow
                else ""
            )
            raise MemoryBudgetError(
                f"{label}: reload(atomic=True) stages {format_bytes(staged)} on {device} before "
                f"committing{views}: {format_bytes(nbytes)} ({nbytes} bytes) in all, but only "
                f"{format_bytes(free or 0)} is available ({where}). Refused before reading; the "
                "model is unchanged. Reload without atomic=True (a failure then names the "
                "tensors written), or free memory",
                nbytes,
            )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[start, stop)`` a tensor's elements lie in (strides are not negative)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return (t.data_ptr(), t.data_ptr() + reach * t.element_size())


@contextmanager
def sigint_deferred(note: str | None = None) -> Iterator[None]:
    """Holds a Ctrl-C back until the block is done, then delivers it to the handler it would
    have reached (Python's: ``KeyboardInterrupt``, with ``note`` added when the block completed;
    ignored; the default: the process ends). Only the main thread can hold it, and only a
    handler set from Python can be put back."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    completed = False
    try:
        yield
        completed = True
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt as exc:
                if completed and note:
                    exc.add_note(note)
                raise


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
    """The model and each of its submodules refuse to run (``ReloadError``), called or through
    their ``forward``, until :func:`unmark`; the digests of what may have changed no longer
    describe the model's bytes, so no later reload skips them."""
    for entry in record.entries:
        if entry.name in names:
            for part in entry.parts:
                record.digests.pop(part.stored, None)
    if record.torn is not None:
        record.torn[0].remove()
    record.torn = (_Refusal(model, _Refuse(message, names)), names)


class _Refuse:
    """What a torn model's modules run instead of their ``forward`` (a class, not a closure: a
    torn model still pickles)."""

    def __init__(self, message: str, names: list[str]) -> None:
        self.message, self.names = message, names

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ReloadError(self.message, self.names)


class _Refusal:
    """``refuse`` set as the instance attribute ``forward`` of every module of ``model``:
    ``module(x)`` (through ``nn.Module.__call__``, hooks included) and ``module.forward(x)`` both
    reach it, for the model and for each submodule, where a forward pre-hook on the model saw
    only ``model(x)``. Nothing is installed while the model is whole: it costs nothing then.
    :meth:`remove` puts back what each module had (a ``forward`` of its own that a wrapper such
    as accelerate's set, or none)."""

    def __init__(self, model: nn.Module, refuse: _Refuse) -> None:
        self.refuse = refuse
        self.saved: list[tuple[nn.Module, Any]] = []
        for module in model.modules():
            self.saved.append((module, module.__dict__.get("forward", _NONE)))
            module.__dict__["forward"] = refuse

    def remove(self) -> None:
        for module, own in self.saved:
            if module.__dict__.get("forward") is not self.refuse:
                continue  # replaced since by someone else: theirs now
            if own is _NONE:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = own
        self.saved = []


_NONE = object()


def unmark(record: LoadRecord) -> None:
    """Lets the model run again (a reload succeeded)."""
    if record.torn is not None:
        record.torn[0].remove()
        record.torn = None
