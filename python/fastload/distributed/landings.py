"""Where the bytes of an exchanged chunk land: straight in the tensors they belong to.

A chunk of a collective read (:func:`fastload.distributed.collective.read_collectively`) is a run
of file bytes that tensors the load needs cover end to end. A rank keeps only some bytes of a
tensor under a tensor-parallel plan (its slice: :mod:`fastload.distributed.needs`), and each byte
it keeps has one place to go (:meth:`Target.place`): the destination itself where the bytes need
no conversion (one contiguous CPU tensor of the stored dtype: the whole tensor, or its slice laid
out as the slice is), else an assembly buffer (of the slice's bytes where a slice is all the
destination takes; converted or sliced once complete). So the owner fetches a chunk from object
storage into those places, and the others receive their bytes there, run by run
(:func:`landing`): no chunk buffer holds the bytes on their way, and no tensor a rank keeps a
slice of is assembled whole. The owner holds the bytes it fetched for the others only, until it
has sent them, in a scratch buffer of the chunk (:func:`landing` with ``forward``). Small pieces
travel packed, in one message per chunk (:func:`take`, :func:`put`), so a chunk of many small
tensors is not many messages; bytes that lie one after the other in memory go as one view.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import torch

from fastload.core.basics.dtypes import to_st, to_torch
from fastload.core.checkpoint.opened import StoredTensor
from fastload.distributed.needs import ALL, Need, kept_size, laid_at, laid_size, runs, size

#: pieces below this many bytes are packed with the chunk's other small pieces into one message
#: (a larger piece goes from and to where it lies, with no buffer on the way: at 1 MiB, a 4-rank
#: load's row-wise shards of a small model went packed through buffers of a few MiB per chunk)
SMALL_PIECE = 256 << 10

#: file bytes ``[lo, hi)`` of a chunk, all in one target
Piece = tuple[int, int, "Target"]


class Run(NamedTuple):
    """File bytes ``[lo, hi)`` of ``target`` and where they are on this rank: from byte ``at`` of
    ``buffer`` (bytes, 1-d); ``kept``: this rank keeps them (else they wait in the owner's
    scratch to be sent). A row-wise shard is one run per row: the run keeps its buffer and
    offset, not a view of its own (a view per row of every chunk in flight was megabytes of
    tensor objects, and most of the exchange's Python time)."""

    lo: int
    hi: int
    buffer: torch.Tensor
    at: int
    target: Target
    kept: bool = True

    @property
    def view(self) -> torch.Tensor:
        """The bytes' place on this rank."""
        return self.buffer[self.at : self.at + self.hi - self.lo]


@dataclass
class Target:
    """A stored tensor the load needs, its place in its file, the copies it feeds, and which of
    its bytes this rank keeps (``needs``, as :func:`fastload.distributed.needs.need_of` describes
    them; the whole tensor unless told)."""

    stored: StoredTensor
    start: int
    fills: list[tuple[torch.Tensor, Any]] = field(default_factory=list)
    needs: list[Need] = field(default_factory=lambda: [ALL])
    whole: torch.Tensor | None = None  # assembled bytes, when a fill needs them converted
    received: int = 0
    # the read-ahead thread lands bytes while the exchange finishes other targets
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @cached_property
    def layout(self) -> Need:
        """How the kept bytes lie where they land: as the one slice the one fill takes (its
        destination's order), else as in the file (``ALL``: an assembly of the whole tensor's
        size, of which only the kept bytes are written)."""
        if len(self.fills) == 1 and len(self.needs) == 1 and _simple(self.fills[0][1]):
            return self.needs[0]
        return ALL

    @cached_property
    def kept(self) -> int:
        """Bytes of the tensor this rank keeps."""
        return kept_size(self.needs, self.stored.nbytes)

    @cached_property
    def direct(self) -> torch.Tensor | None:
        """The one destination the bytes can go to as they arrive: contiguous, on the CPU, the
        stored dtype, the whole tensor or the slice its layout lays out."""
        if len(self.fills) != 1:
            return None
        dest, selection = self.fills[0]
        if (
            _simple(selection)
            and dest.device.type == "cpu"
            and dest.is_contiguous()
            and to_st(dest.dtype) == self.stored.st_dtype
            and dest.numel() * dest.element_size() == laid_size(self.layout, self.stored.nbytes)
        ):
            return dest.view(-1).view(torch.uint8)
        return None

    def place(self, lo: int) -> tuple[torch.Tensor, int]:
        """Where file bytes from ``lo`` of this tensor go (one run of kept bytes, :func:`runs`):
        its destination, or its assembly buffer (made on first use; only the pages written become
        resident), as bytes on the CPU, and the offset there."""
        at = laid_at(self.layout, lo - self.start)
        direct = self.direct
        if direct is not None:
            return direct, at
        with self.lock:
            if self.whole is None:
                room = laid_size(self.layout, self.stored.nbytes)
                self.whole = torch.empty(room, dtype=torch.uint8)
            return self.whole, at

    def runs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The file bytes within ``[lo, hi)`` this rank keeps, as runs that each lie in one
        piece where they land."""
        out = runs(self.needs, self.stored.nbytes, lo - self.start, hi - self.start)
        return [(a + self.start, b + self.start) for a, b in out]


def _simple(selection: Any) -> bool:
    """Whether ``selection`` is the whole tensor, a flat range or a range of one dimension."""
    return selection is None or (isinstance(selection, list | tuple) and len(selection) in (2, 3))


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


def landing(
    parts: Sequence[Piece], forward: Sequence[Sequence[tuple[int, int]]] = (), base: int = 0
) -> list[Run]:
    """Where the bytes of a chunk (its ``parts``) are on this rank: the runs it keeps, at their
    places; and ``forward`` (lists of ranges, offsets from file byte ``base``: bytes this rank
    fetches only to send them on, one list per rank it sends them to), in one scratch buffer,
    list after list, so that each rank's lie one after the other. In file order."""
    out = [
        Run(a, b, *target.place(a), target)
        for lo, hi, target in parts
        for a, b in target.runs(lo, hi)
    ]
    total = sum(size(ranges) for ranges in forward)
    if total:
        scratch = _mapped(total)
        at = 0
        for ranges in forward:
            for a, b, target in _cut(parts, base, ranges):
                out.append(Run(a, b, scratch, at, target, kept=False))
                at += b - a
        out.sort(key=lambda run: run.lo)
    return out


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh memory mapped for one chunk's scratch: given back to the system when
    the tensor goes (a heap allocation, once freed, stayed resident in the heap to the end of
    the load, which then peaked 0.1 of a rank's share higher)."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


#: a message's buffer of this many bytes or more is mapped memory (:func:`transit`)
MAPPED_TRANSIT = 64 << 10


def transit(nbytes: int) -> torch.Tensor:
    """A buffer of ``nbytes`` for bytes on their way (small pieces packed into one message):
    mapped memory, given back to the system when dropped, unless small. (From the heap, freed
    buffers of a few MiB stayed resident to the end of the load: with 4 ranks a rank ended 15-20
    MiB above its tensors in freed heap.)"""
    if nbytes < MAPPED_TRANSIT:
        return torch.empty(nbytes, dtype=torch.uint8)
    return _mapped(nbytes)


def _cut(
    parts: Sequence[Piece], base: int, ranges: Sequence[tuple[int, int]]
) -> list[tuple[int, int, Target]]:
    """``ranges`` (offsets from ``base``), as file bytes cut at the bounds of ``parts``."""
    out = []
    i = 0
    for a, b in ranges:
        lo_abs, hi_abs = base + a, base + b
        while i < len(parts) and parts[i][1] <= lo_abs:
            i += 1
        j = i
        while j < len(parts) and parts[j][0] < hi_abs:
            lo, hi, target = parts[j]
            x, y = max(lo, lo_abs), min(hi, hi_abs)
            if x < y:
                out.append((x, y, target))
            j += 1
    return out


def take(held: Sequence[Run], base: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The bytes of ``ranges`` (offsets from file byte ``base``) from where they are (``held``),
    one after the other (a view where they lie so in memory)."""
    out = _spread(held, base, ranges)
    if len(out) == 1:
        return out[0]
    if not out:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(out, out=transit(sum(v.numel() for v in out)))


def put(
    held: Sequence[Run], base: int, ranges: Sequence[tuple[int, int]], packed: torch.Tensor
) -> None:
    """Puts the bytes :func:`take` packed back where ``held`` says they go."""
    at = 0
    for view in _spread(held, base, ranges):
        view.copy_(packed[at : at + view.numel()])
        at += view.numel()


def into(held: Sequence[Run], base: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """The one view where the bytes of ``ranges`` go, where they lie one after the other in
    memory (then they are received straight there); else ``None``."""
    out = _spread(held, base, ranges)
    return out[0] if len(out) == 1 else None


def _spread(
    held: Sequence[Run], base: int, ranges: Sequence[tuple[int, int]]
) -> list[torch.Tensor]:
    """The views holding ``ranges`` (offsets from ``base``, sorted), in order, those that follow
    each other in one buffer joined (worked out from the runs' offsets: one view per joined
    span, none per run)."""
    # [buffer, its storage's address, first byte in the storage, length] of each joined span
    spans: list[list[Any]] = []
    storages: dict[int, tuple[int, int]] = {}  # id(buffer) -> (storage address, its offset)
    wanted = 0
    i = 0
    for a, b in ranges:
        lo_abs, hi_abs = base + a, base + b
        wanted += b - a
        while i < len(held) and held[i].hi <= lo_abs:
            i += 1
        j = i
        while j < len(held) and held[j].lo < hi_abs:
            run = held[j]
            x, y = max(run.lo, lo_abs), min(run.hi, hi_abs)
            if x < y:
                where = storages.get(id(run.buffer))
                if where is None:
                    storage = run.buffer.untyped_storage().data_ptr()
                    where = storages[id(run.buffer)] = (storage, run.buffer.storage_offset())
                first = where[1] + run.at + x - run.lo
                last = spans[-1] if spans else None
                if last is not None and last[1] == where[0] and last[2] + last[3] == first:
                    last[3] += y - x
                else:
                    spans.append([run.buffer, where[0], first, y - x])
            j += 1
    out = [buffer.as_strided((n,), (1,), first) for buffer, _, first, n in spans]
    got = sum(n for _, _, _, n in spans)
    if got != wanted:  # a bug, not bad input: the owner holds every byte some rank keeps
        raise AssertionError(f"collective load: {wanted - got} bytes to move are held nowhere")
    return out


def messages(
    parts: Sequence[Piece], base: int, ranges: Sequence[tuple[int, int]]
) -> list[list[tuple[int, int]]]:
    """``ranges`` (offsets from file byte ``base``, sorted) as the messages that carry them: the
    ranges in each of ``parts`` with :data:`SMALL_PIECE` bytes or more one message, the rest
    one more, last (alike on the sender and the receiver)."""
    out: list[list[tuple[int, int]]] = []
    small: list[tuple[int, int]] = []
    i = 0
    for lo, hi, _ in parts:
        lo, hi = lo - base, hi - base
        inside = []
        while i < len(ranges) and ranges[i][0] < hi:
            a, b = max(ranges[i][0], lo), min(ranges[i][1], hi)
            if a < b:
                inside.append((a, b))
            if ranges[i][1] > hi:
                break  # its rest lies in the next piece
            i += 1
        if size(inside) >= SMALL_PIECE:
            out.append(inside)
        else:
            small.extend(inside)
    if small:
        out.append(small)
    return out


def settle(held: Sequence[Run]) -> None:
    """Counts the kept runs' bytes as arrived; a tensor whose kept bytes have all arrived in its
    assembly buffer is copied into its destinations (:func:`finish`)."""
    for run in held:
        if not run.kept:
            continue
        target = run.target
        target.received += run.hi - run.lo
        if target.received == target.kept and target.whole is not None:
            finish(target)


def scatter(start: int, stop: int, buffer: torch.Tensor, targets: Sequence[Target]) -> None:
    """Copies the kept bytes of file bytes ``[start, stop)`` (held in ``buffer``) where
    ``targets`` land them, counting them as arrived."""
    data = buffer.to("cpu") if buffer.device.type != "cpu" else buffer
    held = []
    for target in targets:
        lo, hi = max(target.start, start), min(target.start + target.stored.nbytes, stop)
        for a, b in target.runs(lo, hi) if lo < hi else ():
            run = Run(a, b, *target.place(a), target)
            run.view.copy_(data[a - start : b - start])
            held.append(run)
    settle(held)


def finish(target: Target) -> None:
    """Copies an assembled stored tensor (or the slice its one fill takes) into each destination
    (its selection, converted to the destination's dtype), then drops it."""
    stored = target.stored
    assert target.whole is not None
    dtype = to_torch(stored.st_dtype, where=f"tensor {stored.name!r}")
    if target.layout != ALL:  # the slice, laid out as it is
        dest, _ = target.fills[0]
        with torch.no_grad():
            dest.copy_(target.whole.view(dtype).reshape(dest.shape))
        target.whole = None
        return
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


__all__ = [
    "SMALL_PIECE",
    "Piece",
    "Run",
    "Target",
    "finish",
    "into",
    "landing",
    "messages",
    "pieces",
    "put",
    "scatter",
    "settle",
    "take",
    "transit",
]
