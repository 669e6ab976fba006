"""One chunk of a collective load on its way (:mod:`fastload.distributed.collective`): from the
rank that read it, its owner, to every rank that keeps some of its bytes.

On the CPU the bytes travel from where they are held on the owner (its own tensors, the scratch
of bytes it only sends on, or a local file's read buffer) straight to where they land on the
others (:mod:`fastload.distributed.landings`): broadcast where every rank keeps the whole chunk,
else each rank sent only its ranges, a large piece one message of its own. A chunk the tensors do
not cover end to end, and every chunk on an accelerator, goes through a buffer
(:func:`move_buffer`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fastload.distributed.file_reads import Chunk
from fastload.distributed.group import RankGroup
from fastload.distributed.landings import (
    SMALL_PIECE,
    Piece,
    Run,
    Target,
    into,
    landing,
    messages,
    pieces,
    put,
    settle,
    take,
    transit,
)
from fastload.distributed.needs import Routes, merged, pack, size, unpack, without
from fastload.distributed.object_reads import Fetched

__all__ = ["alone", "land_chunk", "move_buffer", "owner_landing", "sends_of"]


def sends_of(group: RankGroup, routes: Routes, chunk: Chunk) -> dict[int, list[tuple[int, int]]]:
    """The byte ranges of ``chunk`` (offsets in it) that each other rank keeps, where it keeps
    some: what this rank, its owner, sends them."""
    out = {}
    for r in range(group.world_size):
        ranges = routes.of(r, chunk.file, chunk.start, chunk.stop) if r != group.rank else []
        if ranges:
            out[r] = ranges
    return out


def alone(group: RankGroup, routes: Routes, chunk: Chunk) -> bool:
    """Whether no rank but its owner keeps a byte of ``chunk`` (then nothing of it crosses the
    group): decided from every rank's needs, alike on every rank."""
    if routes.broadcast(chunk.file, chunk.start, chunk.stop):
        return group.world_size == 1
    return not any(
        routes.of(r, chunk.file, chunk.start, chunk.stop)
        for r in range(group.world_size)
        if r != chunk.owner
    )


def owner_landing(
    group: RankGroup,
    by_file: dict[int, list[Target]],
    routes: Routes,
    file: int,
    start: int,
    stop: int,
) -> list[Run] | None:
    """Where this rank, the owner of the chunk ``[start, stop)`` of ``file``, fetches its bytes
    (:func:`~fastload.distributed.landings.landing`): those it keeps to their places; those only
    other ranks keep to a scratch buffer (each rank's together), sent on and freed with the
    chunk; none where no rank keeps them. ``None``: the chunk goes through a buffer."""
    parts = pieces(start, stop, by_file.get(file, ()))
    if parts is None:
        return None
    forward: list[list[tuple[int, int]]] = []
    if not routes.broadcast(file, start, stop):
        sent = routes.of(group.rank, file, start, stop)  # this rank's own bytes: in place
        for ranges in sends_of(group, routes, Chunk(file, start, stop, group.rank)).values():
            forward.append(without(ranges, sent))  # each rank's together: sent as one view
            sent = merged([*sent, *ranges])
    return landing(parts, [f for f in forward if f], start)


def land_chunk(
    group: RankGroup,
    index: int,
    chunk: Chunk,
    parts: Sequence[Piece],
    got: Any,
    routes: Routes,
    count: int,
) -> int:
    """Chunk ``index`` (of ``count``; ``parts``: its pieces) moved where its bytes land on
    every rank (:func:`move_landed`), and counted as arrived there; ``got``: what the owner's
    reader gave it (the bytes already where they are held, or its read buffer). The bytes
    received."""
    if isinstance(got, Fetched):  # fetched where the bytes are held
        kept = held = got.held
    else:
        kept = held = landing(parts)
        if got is not None:  # the owner's read buffer: to their places, sent from there
            for run in kept:
                run.view.copy_(got[run.lo - chunk.start : run.hi - chunk.start])
            held = [Run(chunk.start, chunk.stop, got, 0, parts[0][2], kept=False)]
    received = move_landed(group, index, chunk, parts, held, routes, count)
    settle(kept)
    return received


def move_buffer(
    group: RankGroup, index: int, chunk: Chunk, buffer: torch.Tensor, routes: Routes
) -> int:
    """Chunk ``index`` from its owner's ``buffer`` into the others'; the bytes received."""
    mine = chunk.owner == group.rank
    if routes.broadcast(chunk.file, chunk.start, chunk.stop):
        group.broadcast(buffer, chunk.owner)
        return 0 if mine else chunk.nbytes
    if mine:
        sends = sends_of(group, routes, chunk)
        group.send_each({r: pack(buffer, rs) for r, rs in sends.items()}, tag=index)
        return 0
    # (bytes this rank does not keep are left as they were in the buffer: only the kept ones
    # are copied out of it)
    ranges = routes.of(group.rank, chunk.file, chunk.start, chunk.stop)
    if not ranges:
        return 0
    packed = torch.empty(size(ranges), dtype=torch.uint8, device=group.device)
    group.receive(packed, chunk.owner, tag=index)
    unpack(packed, buffer, ranges)
    return packed.numel()


def move_landed(
    group: RankGroup,
    index: int,
    chunk: Chunk,
    parts: Sequence[Piece],
    held: Sequence[Run],
    routes: Routes,
    count: int,
) -> int:
    """Chunk ``index`` (of ``count``) from where its bytes are held on its owner to where they
    land on the others: each large piece its own message, the small ones packed into one; under
    a tensor-parallel plan each rank gets only its ranges, so cut. A message whose bytes lie one
    after the other where they are goes from and to there, with no copy on the way. The bytes
    received."""
    mine, base = chunk.owner == group.rank, chunk.start
    if routes.broadcast(chunk.file, chunk.start, chunk.stop):
        small = []
        for lo, hi, _ in parts:
            if hi - lo >= SMALL_PIECE:
                group.broadcast(take(held, base, [(lo - base, hi - base)]), chunk.owner)
            else:
                small.append((lo - base, hi - base))
        if small:
            packed = take(held, base, small) if mine else transit(size(small))
            group.broadcast(packed, chunk.owner)
            if not mine:
                put(held, base, small, packed)
        return 0 if mine else chunk.nbytes
    # message m of a chunk has its own tag: the receiver takes each where it goes
    if mine:
        sends = {r: messages(parts, base, rs) for r, rs in sends_of(group, routes, chunk).items()}
        for m in range(max((len(ms) for ms in sends.values()), default=0)):
            group.send_each(
                {r: take(held, base, ms[m]) for r, ms in sends.items() if m < len(ms)},
                tag=m * count + index,
            )
        return 0
    received = 0
    ranges = routes.of(group.rank, chunk.file, chunk.start, chunk.stop)
    for m, message in enumerate(messages(parts, base, ranges)):
        place = into(held, base, message)
        if place is None:
            place = transit(size(message))
            group.receive(place, chunk.owner, tag=m * count + index)
            put(held, base, message, place)
        else:
            group.receive(place, chunk.owner, tag=m * count + index)
        received += place.numel()
    return received
