"""Collective reads from object storage: each rank fetches its chunks of the checkpoint with the
engine's ranged GETs, the others' arrive over the process group.

A checkpoint in object storage (``s3://``, ``gs://``, ``az://``, ``http(s)://``) is read as a
local one is (:func:`fastload.distributed.collective.read_collectively`), with two differences:

* The chunks are cut at element boundaries of the tensors they hold (not at pages: a store has
  none), and dealt round robin (chunk ``i`` to rank ``i % N`` where they are of one size)
  rather than in contiguous runs:
  while the group exchanges one rank's chunk, every other rank is fetching its next one, so all
  ranks' links to the store are busy at once (:func:`deal_objects`).
* A chunk is fetched by the engine's copy, the path a single-process load from object storage
  takes (parallel ranged GETs pinned to the version opened, their bytes written as they arrive,
  the GIL released), straight where the bytes land (the rank's tensors, its slices or their
  assembly, :mod:`fastload.distributed.landings`; the bytes only other ranks keep into a scratch
  buffer; into a chunk buffer on a CUDA group): each run of the chunk's bytes is one copy job of
  a tensor's elements (:class:`ObjectReader`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.engine import copy_into
from fastload.core.basics.errors import LoadCancelledError
from fastload.distributed.landings import Run
from fastload.distributed.read_ahead import ReadAhead

#: bytes of one chunk from object storage (smaller when the checkpoint is small)
OBJECT_CHUNK_BYTES = 16 << 20
#: the fewest bytes a chunk from object storage is cut to: below this the requests' round trips,
#: not the bytes, set a fetch's time
MIN_OBJECT_CHUNK = 1 << 20
#: bytes of one chunk of tensors that some rank keeps a part of (row-wise shards): its owner
#: holds what it fetches only for the others in a scratch buffer until it has sent them
FORWARD_CHUNK_BYTES = 4 << 20
#: chunks a rank may fetch ahead of the exchange
OBJECT_READ_AHEAD = 3

#: (file index, start, stop, stored name, safetensors dtype) of a stored tensor a load needs,
#: at its absolute place in its file
Extent = tuple[int, int, int, str, str]


def deal_objects(
    extents: Sequence[Extent],
    world_size: int,
    turn: int = 0,
    keepers: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    forwarded: Collection[str] = (),
) -> list[tuple[int, int, int, int]]:
    """``(file, start, stop, owner)`` chunks of the bytes of ``extents`` (sorted by file and
    place, not overlapping): about :data:`OBJECT_CHUNK_BYTES` each (at least
    :data:`MIN_OBJECT_CHUNK`, fewer bytes where the checkpoint is small, so that every rank has
    several), in file order, cut only where an element of a tensor ends (a packed sub-byte tensor
    is never cut), and dealt round robin, balanced by bytes, from rank ``turn % world_size``
    on (a caller making many small reads turns it, so that their first chunks spread).

    ``keepers``: by tensor name, ``(lo, hi, rank)`` ranges of it (offsets in the tensor) that
    one rank alone keeps (:func:`~fastload.distributed.needs.sole_keepers`: a column-wise slice
    under a tensor-parallel plan). Each such range of :data:`MIN_OBJECT_CHUNK` bytes or more is
    chunked on its own and dealt to that rank, which fetches it straight into its slice: those
    bytes cross no link between the ranks, and no rank fetches them only to send them on.
    ``forwarded``: the tensors some rank keeps a part of; where no one rank alone keeps their
    bytes (row-wise slices), their chunks are of at most :data:`FORWARD_CHUNK_BYTES`, which bounds
    the scratch their owner holds for the others."""
    total = sum(stop - start for _, start, stop, _, _ in extents)
    size = max(MIN_OBJECT_CHUNK, min(OBJECT_CHUNK_BYTES, total // max(1, world_size * 8)))
    bits = _core.dtype_bits()
    out: list[tuple[int, int, int, int | None]] = []
    open_chunk: list[Any] | None = None  # [file, start, stop, sole keeper or None] being filled
    for file, start, stop, name, st_dtype in extents:
        item = bits[st_dtype] // 8 if bits[st_dtype] % 8 == 0 else 0
        for lo, hi, keeper in _segments(start, stop, (keepers or {}).get(name, ())):
            # where the owner fetches bytes for others only: its scratch, smaller chunks
            limit = min(size, FORWARD_CHUNK_BYTES) if keeper is None and name in forwarded else size
            if open_chunk is not None and (open_chunk[0], open_chunk[2], open_chunk[3]) != (
                file,
                lo,
                keeper,
            ):
                out.append((open_chunk[0], open_chunk[1], open_chunk[2], open_chunk[3]))
                open_chunk = None
            at = lo
            while at < hi:
                if open_chunk is not None and open_chunk[2] - open_chunk[1] >= limit:
                    out.append((open_chunk[0], open_chunk[1], open_chunk[2], open_chunk[3]))
                    open_chunk = None
                if open_chunk is None:
                    open_chunk = [file, at, at, keeper]
                room = open_chunk[1] + limit - at
                if item == 0:  # packed: whole, into this chunk or the next
                    if at > open_chunk[1] and hi - at > room:
                        out.append((open_chunk[0], open_chunk[1], at, keeper))
                        open_chunk = [file, at, at, keeper]
                    end = hi
                else:
                    end = min(hi, at + max(item, room // item * item))
                open_chunk[2] = end
                at = end
                if open_chunk[2] - open_chunk[1] >= limit:
                    out.append((open_chunk[0], open_chunk[1], open_chunk[2], keeper))
                    open_chunk = None
    if open_chunk is not None:
        out.append((open_chunk[0], open_chunk[1], open_chunk[2], open_chunk[3]))
    # round robin, each chunk to the rank with the fewest bytes so far (the next in turn among
    # equals): chunks of equal size go 0, 1, ..., N-1, 0, ...; a short one (a file's last) does
    # not leave one rank a chunk ahead for the rest of the load. A chunk one rank alone keeps
    # is that rank's (counted, so that the others take more of the rest).
    dealt = [0] * world_size
    chunks = []
    for f, a, b, keeper in out:
        owner = keeper
        if owner is None:
            owner = min(range(world_size), key=lambda r: (dealt[r], (r - turn) % world_size))
        dealt[owner] += b - a
        chunks.append((f, a, b, owner))
    return chunks


def _segments(
    start: int, stop: int, keepers: Sequence[tuple[int, int, int]]
) -> list[tuple[int, int, int | None]]:
    """File bytes ``[start, stop)`` of one tensor as ``(lo, hi, rank)`` runs: those of
    ``keepers`` (offsets in the tensor) of :data:`MIN_OBJECT_CHUNK` bytes or more with the rank
    that alone keeps them, the rest with ``None``."""
    out: list[tuple[int, int, int | None]] = []
    at = start
    for lo, hi, rank in keepers:
        if hi - lo < MIN_OBJECT_CHUNK:
            continue  # fetched with its neighbours: a request of its own would cost more
        if start + lo > at:
            out.append((at, start + lo, None))
        out.append((start + lo, start + hi, rank))
        at = start + hi
    if at < stop:
        out.append((at, stop, None))
    return out


def chunk_jobs(
    extents: Sequence[Extent], file: int, start: int, stop: int, buffer: torch.Tensor
) -> list[tuple[str, torch.Tensor, str, list[int] | None]]:
    """The engine's copy items that fill ``buffer`` with file bytes ``[start, stop)`` of
    ``file``: for each tensor of ``extents`` there, its elements in the chunk, as they are
    stored, at their place in ``buffer``."""
    bits = _core.dtype_bits()
    items: list[tuple[str, torch.Tensor, str, list[int] | None]] = []
    for f, t_start, t_stop, name, st_dtype in extents:
        lo, hi = max(t_start, start), min(t_stop, stop)
        if f != file or lo >= hi:
            continue
        dest = buffer[lo - start : hi - start]
        if (lo, hi) == (t_start, t_stop):
            items.append((name, dest, st_dtype, None))
        else:  # a part of the tensor: its elements (the chunk was cut between elements)
            item = bits[st_dtype] // 8
            items.append((name, dest, st_dtype, [(lo - t_start) // item, (hi - t_start) // item]))
    return items


def landed_jobs(held: Sequence[Run]) -> list[tuple[str, torch.Tensor, str, list[int] | None]]:
    """The engine's copy items that fetch each run of a chunk where it is held. The runs of one
    tensor that lie in one buffer one after the other, each the same part of rows one stride
    apart in the file (a row-wise shard's rows: one run per row), are one item of those rows
    (the engine reads the rows that follow each other in the file, any item's, with one GET)."""
    bits = _core.dtype_bits()
    items: list[tuple[str, torch.Tensor, str, list[int] | None]] = []
    for block in _blocks(held, bits):
        first = block[0]
        stored, t_start = first.target.stored, first.target.start
        item = bits[stored.st_dtype] // 8
        width = first.hi - first.lo
        dest = first.buffer[first.at : first.at + width * len(block)]
        if len(block) > 1:  # rows of ``stride`` bytes, ``width`` of each from ``offset``
            stride = block[1].lo - first.lo
            row, offset = divmod(first.lo - t_start, stride)
            selection = [row, len(block), stride // item, offset // item, (offset + width) // item]
            items.append((stored.name, dest, stored.st_dtype, selection))
        elif (first.lo, first.hi) == (t_start, t_start + stored.nbytes):
            items.append((stored.name, dest, stored.st_dtype, None))
        else:  # a part of the tensor: its elements (chunks and slices are cut between elements)
            part = [(first.lo - t_start) // item, (first.hi - t_start) // item]
            items.append((stored.name, dest, stored.st_dtype, part))
    return items


def _blocks(held: Sequence[Run], bits: Mapping[str, int]) -> list[list[Run]]:
    """``held`` (in file order) as blocks of runs that one item of the engine can fetch: runs of
    one tensor of a byte-sized dtype and one buffer, each as long as the first, one stride
    apart in the file (whole elements) and one after the other in the buffer; any other run
    alone. ``bits``: each safetensors dtype's. (The runs of several blocks interleave in the
    file: a scratch holds each other rank's part of every row, rank after rank.)"""
    done: list[list[Run]] = []
    # (target, buffer, where its next run would start there) -> the block that run extends
    open_blocks: dict[tuple[int, int, int], list[Run]] = {}
    for run in held:
        key = (id(run.target), id(run.buffer), run.at)
        block = open_blocks.pop(key, None)
        if block is None or not _extends(block, run, bits[run.target.stored.st_dtype]):
            block = [run]
            done.append(block)
        else:
            block.append(run)
        open_blocks[(key[0], key[1], run.at + run.hi - run.lo)] = block
    return done


def _extends(block: list[Run], run: Run, bits: int) -> bool:
    """Whether ``run`` continues ``block`` (runs of one tensor and buffer) as a block of rows."""
    last = block[-1]
    width = block[0].hi - block[0].lo
    if bits % 8 or run.hi - run.lo != width or run.at != last.at + width:
        return False
    stride = run.lo - last.lo
    if len(block) > 1:
        return stride == block[1].lo - block[0].lo
    item = bits // 8
    offset = (last.lo - run.target.start) % stride if stride > 0 else -1
    whole_elements = stride % item == offset % item == width % item == 0
    return 0 <= offset and offset + width <= stride and whole_elements


@dataclass
class Fetched:
    """A chunk fetched where its bytes are held (:func:`fastload.distributed.landings.landing`:
    the places of the bytes this rank keeps, and the scratch of those it only sends on), and the
    read-ahead's token, given back once the chunk is sent (``None``: fetched with the chunk
    before it, whose token it shares)."""

    held: list[Run]
    token: torch.Tensor | None


class ObjectReader(ReadAhead):
    """Fetches this rank's chunks in order on a helper thread, at most
    :data:`OBJECT_READ_AHEAD` ahead of the exchange, each with the engine's parallel ranged GETs
    where its bytes land (``land``), else into a chunk buffer. Where they land, two fetches run
    at once: the threads of the engine's pool that the first one's last GETs leave idle take up
    the next one's GETs (one fetch after the other, a 2-rank tensor-parallel load of 1 GiB kept
    its link to the store about 80% busy). A failure is handed to the exchange (:meth:`next`
    raises it), which tells the other ranks; leaving the ``with`` block cancels a fetch under
    way."""

    thread_name = "fastload-fleet"

    def __init__(
        self,
        files: Sequence[Any],
        extents: Sequence[Extent],
        chunks: Sequence[tuple[int, int, int]],
        device: torch.device,
        threads: int | None,
        land: Callable[[int, int, int], list[Run] | None] | None = None,
        alone: Sequence[bool] = (),
    ) -> None:
        self.files = files
        #: where each chunk's bytes go (:func:`fastload.distributed.landings.landing`): with it,
        #: chunks are fetched there and the read-ahead holds no chunk buffers (only the scratch
        #: of bytes this rank sends on without keeping them)
        self.land = land
        self.lands = land is not None
        #: by chunk: whether no other rank keeps a byte of it (nothing to send on: no scratch)
        self.alone = list(alone) or [False] * len(chunks)
        self.extents = extents
        self.chunks = list(chunks)
        self.threads = threads
        self.progress = _core.Progress()
        size = 0 if self.lands else max((b - a for _, a, b in self.chunks), default=0)
        super().__init__(len(self.chunks), size, OBJECT_READ_AHEAD, device)
        if self.lands:  # on the CPU: the next fetch's GETs start as the last one's end
            self.overlap = 2

    def _prepare(
        self, index: int, buffer: torch.Tensor, session: Any
    ) -> tuple[int, Callable[[], list[Any]]]:
        """Chunk ``index``, and with it the next chunks of the file that no other rank keeps a
        byte of (a rank's column-wise slices, chunks of a few MiB), up to
        :data:`OBJECT_CHUNK_BYTES` in all: fetched with one call of the engine's copy, their
        ranged GETs in parallel as one chunk's are, not one small chunk after the other. The
        bytes land where they stay, so the others need no token of the read-ahead. Where the
        bytes land is worked out here, in order; the fetch may run beside the one before it
        (:attr:`ReadAhead.overlap`)."""
        file, start, stop = self.chunks[index]
        land = self.land
        held = land(file, start, stop) if land is not None else None
        if land is None or held is None:  # through a buffer (:meth:`_fill`): alone, as dealt
            return super()._prepare(index, buffer, session)
        helds = [held]
        nbytes = stop - start
        while (
            index + len(helds) < self.count
            and self.alone[index + len(helds)]
            and self.chunks[index + len(helds)][0] == file
            and nbytes < OBJECT_CHUNK_BYTES
        ):
            _, a, b = self.chunks[index + len(helds)]
            held = land(file, a, b)
            if held is None:  # fetched on its own, next
                break
            helds.append(held)
            nbytes += b - a

        def fetch() -> list[Any]:
            items = [item for held in helds for item in landed_jobs(held)]
            copy_into(self.files[file], items, self.threads, self.progress)
            return [Fetched(held, buffer if n == 0 else None) for n, held in enumerate(helds)]

        return len(helds), fetch

    def _fill(self, index: int, buffer: torch.Tensor, session: Any) -> torch.Tensor:
        """Chunk ``index`` fetched into ``buffer`` (the start of it): what it holds of it."""
        file, start, stop = self.chunks[index]
        view = buffer[: stop - start]
        items = chunk_jobs(self.extents, file, start, stop, view)
        copy_into(self.files[file], items, self.threads, self.progress)
        return view

    def release(self, got: torch.Tensor | Fetched) -> None:
        if isinstance(got, Fetched):
            got.held = []  # the chunk is sent: its scratch goes now
            if got.token is None:  # fetched with the chunk before it, which holds the token
                return
            got = got.token
        super().release(got)

    def _abandoned(self, error: BaseException) -> bool:
        return isinstance(error, LoadCancelledError)  # the exchange is over: nobody waits

    def _cancel(self) -> None:
        self.progress.cancel()  # abandons the requests in flight


__all__ = ["OBJECT_CHUNK_BYTES", "Fetched", "ObjectReader", "chunk_jobs", "deal_objects"]
