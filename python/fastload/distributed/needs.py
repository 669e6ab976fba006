"""Which bytes of each exchanged chunk each rank keeps, so that a rank receives only those.

In a load without tensor parallelism every rank needs every byte, and each chunk is broadcast.
Under a tensor-parallel plan a rank keeps a slice of most tensors (a range of one dimension: the
rows of a column-wise weight, a range of each row of a row-wise one): the chunk's owner then sends
each other rank only the bytes of its slices (:func:`ranges_in`, packed by :func:`pack`), and the
others' parts of the chunk never cross the network to it.

A rank's need of a tensor is described compactly (:func:`need_of`: the whole tensor, a flat
range of elements, or a range of one dimension) and gathered once per read; every rank derives
the byte ranges from the descriptions, the owner for each receiver of its chunks, a receiver for
itself, so both cut a chunk the same way.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import torch

from fastload import _core

#: a rank's need of one tensor: ``("all",)``, ``("flat", first byte, stop byte)`` or ``("dim",
#: outer count, row bytes, first byte in a row, stop byte in a row)`` (the bytes of a range of one
#: dimension repeat once per index of the dimensions before it)
Need = tuple[Any, ...]
ALL: Need = ("all",)


def need_of(shape: Sequence[int], st_dtype: str, selections: Sequence[Any]) -> list[Need]:
    """The bytes of a stored tensor (``shape``, ``st_dtype``) that the copies of ``selections``
    (one per destination: ``None`` the whole tensor, ``[start, stop]`` a flat range of elements,
    ``[dim, start, stop]`` a range of one dimension, anything else the whole) read."""
    bits = _core.dtype_bits()[st_dtype]
    if bits % 8:  # packed sub-byte elements: never cut
        return [ALL]
    item = bits // 8
    out: list[Need] = []
    for selection in selections:
        if selection is None or not isinstance(selection, list | tuple):
            return [ALL]
        if len(selection) == 2:
            start, stop = selection
            out.append(("flat", start * item, stop * item))
        elif len(selection) == 3:
            dim, start, stop = selection
            inner = math.prod(shape[dim + 1 :]) * item
            outer = math.prod(shape[:dim])
            if start == 0 and stop == shape[dim]:
                return [ALL]
            out.append(("dim", outer, shape[dim] * inner, start * inner, stop * inner))
        else:
            return [ALL]
    return out


def _ranges_of(need: Need, nbytes: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The byte ranges of ``need`` (offsets in its tensor of ``nbytes`` bytes) within
    ``[lo, hi)``, clipped to it."""
    kind = need[0]
    if kind == "all":
        return [(lo, hi)]
    if kind == "flat":
        a, b = max(lo, need[1]), min(hi, need[2])
        return [(a, b)] if a < b else []
    _, outer, row, first, stop = need
    out: list[tuple[int, int]] = []
    for o in range(max(0, lo // row), min(outer, -(-hi // row))):
        a, b = max(lo, o * row + first), min(hi, o * row + stop)
        if a < b:
            out.append((a, b))
    return out


def runs(needs: Sequence[Need], nbytes: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The byte ranges that ``needs`` (of one tensor of ``nbytes`` bytes) keep within
    ``[lo, hi)`` (offsets in the tensor), sorted and merged."""
    return merged([r for need in needs for r in _ranges_of(need, nbytes, lo, hi)])


def kept_size(needs: Sequence[Need], nbytes: int) -> int:
    """Bytes of a tensor of ``nbytes`` bytes that ``needs`` keep."""
    if len(needs) == 1:
        return laid_size(needs[0], nbytes)
    return size(runs(needs, nbytes, 0, nbytes))


def laid_size(need: Need, nbytes: int) -> int:
    """Bytes of the kept part of a tensor of ``nbytes`` bytes that ``need`` keeps."""
    if need[0] == "all":
        return nbytes
    if need[0] == "flat":
        return need[2] - need[1]
    _, outer, _, first, stop = need
    return outer * (stop - first)


def laid_at(need: Need, offset: int) -> int:
    """Where byte ``offset`` of a tensor (one ``need`` keeps) is in the kept part laid out on its
    own, in order (the bytes of the selection ``need`` describes: a slice's destination)."""
    if need[0] == "all":
        return offset
    if need[0] == "flat":
        return offset - need[1]
    _, _, row, first, stop = need
    return offset // row * (stop - first) + offset % row - first


def ranges_in(
    needs: dict[str, list[Need]],
    targets: Sequence[tuple[str, int, int]],
    chunk_start: int,
    chunk_stop: int,
) -> list[tuple[int, int]]:
    """The byte ranges of the chunk ``[chunk_start, chunk_stop)`` of one file (offsets in the
    chunk, sorted, merged) that a rank with ``needs`` (tensor name -> its needs) keeps;
    ``targets``: ``(name, start, stop)`` of the tensors of that file the load reads, at their
    places in the file."""
    spans: list[tuple[int, int]] = []
    for name, t_start, t_stop in targets:
        lo, hi = max(t_start, chunk_start), min(t_stop, chunk_stop)
        if lo >= hi or name not in needs:
            continue
        for need in needs[name]:
            for a, b in _ranges_of(need, t_stop - t_start, lo - t_start, hi - t_start):
                spans.append((a + t_start - chunk_start, b + t_start - chunk_start))
    return merged(spans)


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, those that overlap or touch joined."""
    spans.sort()
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def without(
    ranges: Sequence[tuple[int, int]], taken: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The parts of ``ranges`` outside ``taken`` (both sorted, merged)."""
    out: list[tuple[int, int]] = []
    i = 0
    for a, b in ranges:
        while i < len(taken) and taken[i][1] <= a:
            i += 1
        j, at = i, a
        while j < len(taken) and taken[j][0] < b:
            if taken[j][0] > at:
                out.append((at, taken[j][0]))
            at = max(at, taken[j][1])
            j += 1
        if at < b:
            out.append((at, b))
    return out


def _one_range(need: Need, nbytes: int) -> tuple[int, int] | None:
    """The one byte range of a tensor of ``nbytes`` bytes that ``need`` keeps, or ``None``
    where its bytes are not one range (a range of each row)."""
    if need[0] == "all":
        return 0, nbytes
    if need[0] == "flat":
        return need[1], need[2]
    _, outer, row, first, stop = need
    if outer == 1:
        return first, stop
    return (0, nbytes) if (first, stop) == (0, row) else None


def sole_keepers(
    everyone: Sequence[dict[str, list[Need]]], name: str, nbytes: int
) -> list[tuple[int, int, int]]:
    """``(lo, hi, rank)``: the byte ranges of tensor ``name`` (``nbytes`` bytes; offsets in it,
    sorted) that one rank alone keeps, each one range that rank keeps whole and no other rank
    keeps a byte of (a column-wise slice). None where a rank keeps more than one range of it (a
    row-wise slice: a range of every row) or the ranks' ranges overlap (a replicated tensor).
    Alike on every rank: derived from ``everyone``'s needs alone."""
    spans = []
    for rank, needs in enumerate(everyone):
        got = needs.get(name)
        if not got:
            continue  # this rank keeps none of it
        span = _one_range(got[0], nbytes) if len(got) == 1 else None
        if span is None:
            return []
        spans.append((*span, rank))
    spans.sort()
    for (_, b, _), (a, _, _) in zip(spans, spans[1:], strict=False):
        if a < b:  # two ranks keep some bytes alike
            return []
    return [s for s in spans if s[0] < s[1]]


class Routes:
    """Who keeps which bytes of each chunk of a read: ``everyone``, each rank's needs (tensor
    name -> its :data:`Need` list, as :func:`need_of` describes them); ``tensors``, file index ->
    ``(name, start, stop)`` of the tensors the read covers there."""

    def __init__(
        self,
        everyone: Sequence[dict[str, list[Need]]],
        tensors: dict[int, list[tuple[str, int, int]]],
    ) -> None:
        self.everyone = everyone
        #: each file's tensors in file order, and where each ends (to find a chunk's by bisection:
        #: a read has thousands of chunks, a file hundreds of tensors)
        self.tensors = {f: sorted(ts, key=lambda t: t[1]) for f, ts in tensors.items()}
        self._ends = {f: [t[2] for t in ts] for f, ts in self.tensors.items()}
        #: the tensors some rank keeps only a part of (or none of), decided once
        self.partial = {
            name
            for ts in self.tensors.values()
            for name, _, _ in ts
            if any(needs.get(name) != [ALL] for needs in everyone)
        }

    def _within(self, file: int, start: int, stop: int) -> list[tuple[str, int, int]]:
        """The tensors of ``file`` that bytes ``[start, stop)`` overlap."""
        ts = self.tensors.get(file, [])
        first = bisect.bisect_right(self._ends.get(file, []), start)
        out = []
        for t in ts[first:]:
            if t[1] >= stop:
                break
            out.append(t)
        return out

    def broadcast(self, file: int, start: int, stop: int) -> bool:
        """Whether every rank keeps every byte of the chunk (then it is broadcast): decided
        from the descriptions alone, alike on every rank."""
        return not any(name in self.partial for name, _, _ in self._within(file, start, stop))

    def of(self, rank: int, file: int, start: int, stop: int) -> list[tuple[int, int]]:
        """The byte ranges of the chunk (offsets in it) that ``rank`` keeps."""
        return ranges_in(self.everyone[rank], self._within(file, start, stop), start, stop)


def pack(buffer: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The bytes of ``ranges`` of ``buffer``, one after the other."""
    if not ranges:
        return buffer[:0]
    if len(ranges) == 1:
        a, b = ranges[0]
        return buffer[a:b]
    return torch.cat([buffer[a:b] for a, b in ranges])


def unpack(packed: torch.Tensor, buffer: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
    """Puts the bytes :func:`pack` made back at their places in ``buffer``."""
    at = 0
    for a, b in ranges:
        buffer[a:b].copy_(packed[at : at + b - a])
        at += b - a


def size(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges)


__all__ = [
    "ALL",
    "Need",
    "Routes",
    "kept_size",
    "laid_at",
    "laid_size",
    "merged",
    "need_of",
    "pack",
    "ranges_in",
    "runs",
    "size",
    "sole_keepers",
    "unpack",
    "without",
]
