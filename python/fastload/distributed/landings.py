"""Where the bytes of an exchanged chunk land: straight in the tensors they belong to.

A chunk of a collective read (:func:`fastload.distributed.collective.read_collectively`) is a run
of file bytes that tensors the load needs cover end to end. Each tensor's part of it has one
place to go on every rank (:meth:`Target.land`): the destination itself where the bytes need no
conversion (one contiguous CPU tensor of the stored dtype, the whole tensor), else the tensor's
assembly buffer (converted or sliced once whole). So the owner fetches a chunk from object
storage into those places, and the others receive it there, piece by piece
(:func:`pieces`): no chunk buffer holds the bytes on their way, and a rank's memory during the
load is its tensors plus the tensors being assembled. Small pieces travel packed, in one message
per chunk (:func:`take`, :func:`put`), so a chunk of many small tensors is not many messages.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from fastload.core.basics.dtypes import to_st, to_torch
from fastload.core.checkpoint.opened import StoredTensor

#: pieces below this many bytes are packed with the chunk's other small pieces into one message
SMALL_PIECE = 1 << 20

#: file bytes ``[lo, hi)`` of a chunk, all in one target
Piece = tuple[int, int, "Target"]


@dataclass
class Target:
    """A stored tensor the load needs, its place in its file, and the copies it feeds."""

    stored: StoredTensor
    start: int
    fills: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    whole: torch.Tensor | None = None  # assembled bytes, when a fill needs the whole tensor
    received: int = 0
    # the read-ahead thread lands bytes while the exchange finishes other targets
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @cached_property
    def direct(self) -> torch.Tensor | None:
        """The one destination the bytes can go to as they arrive: contiguous, on the CPU, the
        stored dtype, the whole tensor."""
        if len(self.fills) != 1:
            return None
        dest, selection = self.fills[0]
        if (
            selection is None
            and dest.device.type == "cpu"
            and dest.is_contiguous()
            and to_st(dest.dtype) == self.stored.st_dtype
            and dest.numel() * dest.element_size() == self.stored.nbytes
        ):
            return dest.view(-1).view(torch.uint8)
        return None

    def land(self, lo: int, hi: int) -> torch.Tensor:
        """Where file bytes ``[lo, hi)`` of this tensor go (bytes, on the CPU): its destination,
        or its assembly buffer (made on first use; only the pages written become resident)."""
        direct = self.direct
        if direct is not None:
            return direct[lo - self.start : hi - self.start]
        with self.lock:
            if self.whole is None:
                self.whole = torch.empty(self.stored.nbytes, dtype=torch.uint8)
            return self.whole[lo - self.start : hi - self.start]


def pieces(start: int, stop: int, targets: Sequence[Target]) -> list[Piece] | None:
    """The parts of file bytes ``[start, stop)`` in each of ``targets`` (one file's, in file
    order), or ``None`` unless they cover those bytes end to end, once (then the chunk goes
    through a buffer)."""
    out: list[Piece] = []
    at = start
    for target in targets:
        t_start, t_stop = target.start, target.start + target.stored.nbytes
        lo, hi = max(t_start, start), min(t_stop, stop)
        if lo >= hi:
            continue
        if lo != at:
            return None
        out.append((lo, hi, target))
        at = hi
    return out if at == stop else None


def take(parts: Sequence[Piece], base: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The bytes of ``ranges`` (offsets from file byte ``base``) from where ``parts`` landed,
    one after the other."""
    out = [view for _, _, view in _spread(parts, base, ranges)]
    if len(out) == 1:
        return out[0]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def put(
    parts: Sequence[Piece], base: int, ranges: Sequence[tuple[int, int]], packed: torch.Tensor
) -> None:
    """Puts the bytes :func:`take` packed back where ``parts`` land."""
    at = 0
    for a, b, view in _spread(parts, base, ranges):
        view.copy_(packed[at : at + b - a])
        at += b - a


def _spread(
    parts: Sequence[Piece], base: int, ranges: Sequence[tuple[int, int]]
) -> list[tuple[int, int, torch.Tensor]]:
    """``ranges`` (offsets from ``base``, sorted) cut at the pieces' bounds, each with its
    landing view."""
    out = []
    for a, b in ranges:
        lo_abs, hi_abs = base + a, base + b
        for lo, hi, target in parts:
            x, y = max(lo, lo_abs), min(hi, hi_abs)
            if x < y:
                out.append((x - base, y - base, target.land(x, y)))
    return out


def settle(parts: Sequence[Piece]) -> None:
    """Counts the pieces' bytes as arrived; a tensor whose bytes have all arrived in its assembly
    buffer is copied into its destinations (:func:`finish`)."""
    for lo, hi, target in parts:
        target.received += hi - lo
        if target.received == target.stored.nbytes and target.whole is not None:
            finish(target)


def scatter(start: int, stop: int, buffer: torch.Tensor, targets: Sequence[Target]) -> None:
    """Copies file bytes ``[start, stop)`` (held in ``buffer``) where ``targets`` land them,
    counting them as arrived."""
    data = buffer.to("cpu") if buffer.device.type != "cpu" else buffer
    parts = []
    for target in targets:
        lo, hi = max(target.start, start), min(target.start + target.stored.nbytes, stop)
        if lo < hi:
            target.land(lo, hi).copy_(data[lo - start : hi - start])
            parts.append((lo, hi, target))
    settle(parts)


def finish(target: Target) -> None:
    """Copies an assembled stored tensor into each destination (its selection, converted to the
    destination's dtype), then drops it."""
    stored = target.stored
    assert target.whole is not None
    dtype = to_torch(stored.st_dtype, where=f"tensor {stored.name!r}")
    source = target.whole.view(dtype).view(stored.torch_shape)
    for dest, selection in target.fills:
        part = source
        if hasattr(selection, "take"):  # a richer selection (several ranges of one dimension)
            part = selection.take(source)
        elif selection is not None and len(selection) == 2:
            part = source.reshape(-1)[selection[0] : selection[1]]
        elif selection is not None:
            dim, start, stop = selection
            part = source.narrow(dim, start, stop - start)
        with torch.no_grad():
            dest.copy_(part.reshape(dest.shape))
    target.whole = None


__all__ = ["SMALL_PIECE", "Piece", "Target", "finish", "pieces", "put", "scatter", "settle", "take"]
