"""The staged copy pipeline: file -> a ring of staging slots -> destination device.

Every destination that is not a CPU tensor goes through here (and CPU destinations, when a caller
asks: the same code, which is how it is tested and measured without a GPU).

The ring (:class:`fastload._core.StagedRead`, in Rust) copies *bytes, not tensors*: the
destinations' byte spans are laid out in file order into fills, one slot each, and the ring's own
threads read them ahead, as many reads in flight as it has threads and as far ahead as free slots
allow. Ranges already in the page cache are read out of it; cold ranges are read with direct I/O
(``O_DIRECT``), which skips a copy and leaves no model in the page cache of a host whose GPU now
holds it. This thread takes each fill the moment its reads complete and copies its pieces to their
destinations: asynchronously on a side stream for CUDA (converting dtype there, on the device),
synchronously for CPU destinations; a slot goes back to the readers once the copy out of it is done.

What the ring cannot read as plain bytes is gathered by the engine into the slab instead (one call
per batch, double-buffered): slices along an inner dimension (tensor-parallel columns), packed
sub-byte types, dtype pairs the engine converts but torch cannot view, and pickle checkpoints.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from dataclasses import dataclass

import torch

from fastload import _core
from fastload.core.basics.dtypes import CONVERTIBLE, PACKED, ST_TO_TORCH, TORCH_TO_ST, to_st
from fastload.core.basics.engine import TensorFile, copy_into
from fastload.core.basics.errors import RequestError
from fastload.core.memory.staging import SLOT_UNIT, Slab, StagingPool

#: (tensor name, destination, selection) as :func:`fastload.core.reads.reading.fill` takes them
Item = tuple[str, torch.Tensor, "list[int] | None"]


@dataclass
class _Span:
    """A destination the ring fills: bytes ``[begin, end)`` of tensor ``name`` (relative to the
    tensor), stored as ``stored``, into the flat destination ``dest``."""

    name: str
    dest: torch.Tensor
    stored: torch.dtype
    begin: int
    end: int


def _ring_span(
    file: TensorFile, name: str, dest: torch.Tensor, sel: list[int] | None
) -> _Span | None:
    """The byte span the ring reads for one destination, or ``None`` where the engine must
    gather it (see the module docs)."""
    if not isinstance(file, _core.SafetensorsFile):
        return None
    st_dtype, shape, _, _ = file.info(name)
    stored = ST_TO_TORCH.get(st_dtype)
    if stored is None or st_dtype in PACKED:
        return None
    if dest.dtype != stored and not (st_dtype in CONVERTIBLE and to_st(dest.dtype) in CONVERTIBLE):
        return None  # the engine's refusal names the pair
    itemsize = stored.itemsize
    numel = math.prod(shape)
    if sel is None:
        start, stop = 0, numel
    elif len(sel) == 2:
        start, stop = sel
    elif len(sel) == 3 and 0 <= sel[0] < len(shape) and math.prod(shape[: sel[0]]) == 1:
        inner = math.prod(shape[sel[0] + 1 :])
        start, stop = sel[1] * inner, sel[2] * inner  # rows: contiguous bytes
    else:
        return None
    if not 0 <= start <= stop <= numel:
        return None  # the engine's refusal names the selection
    if dest.numel() != stop - start:
        raise RequestError(
            f"{file.path}: tensor {name!r}: destination has "
            f"{dest.numel() * dest.element_size()} bytes, expected "
            f"{(stop - start) * dest.element_size()}"
        )
    return _Span(name, dest.view(-1), stored, start * itemsize, stop * itemsize)


def stream_into(
    file: TensorFile,
    items: list[Item],
    *,
    pool: StagingPool | None = None,
    threads: int | None = None,
    progress: _core.Progress | None = None,
    direct: bool = True,
    after: torch.cuda.Stream | None = None,
) -> int:
    """Fills destination tensors (any device, one device per call) through ``pool``'s staging
    slots (a default-sized pool for this call when ``None``); returns destination bytes written.
    Every destination is filled when it returns.

    CUDA destinations are written on the pool's side stream once the work queued so far on
    ``after`` (default: the calling thread's current stream) is done: memory a consumer still
    reads there is not overwritten.

    ``direct=False`` reads cold ranges through the page cache instead of past it. A read error,
    a truncated or rewritten file names the file and the tensor; a copy that raises stops the
    ring's threads before the error propagates.
    """
    if not items:
        return 0
    devices = {t.device for _, t, _ in items}
    if len(devices) != 1:
        raise RequestError(f"stream_into takes one destination device per call, got {devices}")
    device = devices.pop()
    for name, dest, _ in items:
        if not dest.is_contiguous():
            raise RequestError(f"tensor {name!r}: staged destinations must be contiguous")
    pool = pool if pool is not None else StagingPool()
    with pool.in_use():  # a pool shared between threads serves one copy at a time
        return _stream(file, items, device, pool, threads, progress, direct, after)


def _stream(
    file: TensorFile,
    items: list[Item],
    device: torch.device,
    pool: StagingPool,
    threads: int | None,
    progress: _core.Progress | None,
    direct: bool,
    after: torch.cuda.Stream | None,
) -> int:
    cuda = device.type == "cuda"
    stream = pool.stream(device) if cuda else None
    if stream is not None:
        # Destinations were allocated on the current stream; writes on the side stream must not
        # overtake work still queued there on memory the caching allocator handed out again.
        stream.wait_stream(after if after is not None else torch.cuda.current_stream(device))
    spans: list[_Span] = []
    gathered: list[Item] = []
    for name, dest, sel in items:
        span = _ring_span(file, name, dest, sel)
        if span is None:
            gathered.append((name, dest, sel))
        elif span.end > span.begin:
            spans.append(span)
    written = 0
    if spans:
        written += _run_ring(file, spans, pool, stream, threads, progress, direct)  # type: ignore[arg-type]
    if gathered:
        written += _gather(file, gathered, pool, stream, threads, progress)
    if stream is not None:
        stream.synchronize()
    return written


def _deliver(
    span: _Span,
    slot: torch.Tensor,
    start: int,
    stop: int,
    offset: int,
    stream: torch.cuda.Stream | None,
) -> int:
    """Copies bytes ``[start, stop)`` of ``span``, at ``offset`` in ``slot``, to the destination
    (on ``stream`` when given); returns destination bytes written."""
    src = slot[offset : offset + stop - start]
    itemsize = span.stored.itemsize
    if src.storage_offset() % itemsize:
        src = src.clone()  # a tensor at an odd offset of the file: view needs aligned storage
    first, last = start // itemsize, stop // itemsize
    dst = span.dest[first:last]
    dst.copy_(src.view(span.stored), non_blocking=stream is not None)
    return dst.numel() * dst.element_size()


def _run_ring(
    file: _core.SafetensorsFile,
    spans: list[_Span],
    pool: StagingPool,
    stream: torch.cuda.Stream | None,
    threads: int | None,
    progress: _core.Progress | None,
    direct: bool,
) -> int:
    cuda = stream is not None
    addresses = pool.slot_addresses(pinned=cuda)
    ring = _core.StagedRead(
        file,
        [(s.name, (s.begin, s.end)) for s in spans],
        addresses,
        pool.slot_bytes,
        threads=threads,
        direct=direct,
        progress=progress,
    )
    slots = len(addresses)
    pending: deque[tuple[int, torch.cuda.Event]] = deque()  # fills whose copies may still run
    written = 0
    try:
        fills = ring.fills()
        for k, pieces in enumerate(fills):
            # Fill k + slots needs fill k's slot: release what the device has finished with, and
            # wait for the copy out of the slot the readers need next.
            while pending and (pending[0][0] <= k - slots or pending[0][1].query()):
                done, event = pending.popleft()
                event.synchronize()
                ring.release(done)
            slot = pool.slot(ring.wait(k))
            ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
            nbytes = 0
            with ctx, torch.no_grad():
                for index, start, stop, offset in pieces:
                    nbytes += _deliver(spans[index], slot, start, stop, offset, stream)
                if stream is not None:
                    event = torch.cuda.Event()
                    event.record(stream)
                    pending.append((k, event))
            if not cuda:
                ring.release(k)
            written += nbytes
            if progress is not None:
                progress.add(nbytes)
        while pending:
            done, event = pending.popleft()
            event.synchronize()
            ring.release(done)
        direct_bytes, cached_bytes = ring.finish()
        pool.direct_bytes += direct_bytes
        pool.cached_bytes += cached_bytes
    finally:
        # On any failure (a read, a copy, Ctrl-C) the readers stop before the slots can go.
        ring.close()
        if stream is not None:
            stream.synchronize()
    return written


@dataclass
class _Piece:
    name: str
    dest: torch.Tensor  # flat view of the destination
    start: int  # first element (of the flattened tensor)
    stop: int
    selection: list[int] | None  # None for whole-tensor reads in one piece
    #: the whole tensor in one piece, read without a selection (the engine cuts no packed
    #: sub-byte tensor, so one is never read as a range of elements)
    whole: bool = False


def _pieces(items: list[Item], buffer_bytes: int) -> list[_Piece]:
    out: list[_Piece] = []
    for name, dest, selection in items:
        numel, itemsize = dest.numel(), dest.element_size()
        flat = dest.view(-1)
        if selection is None and TORCH_TO_ST.get(dest.dtype) in PACKED:
            out.append(_Piece(name, flat, 0, numel, None, whole=True))
            continue
        if selection is not None:
            # A slice is gathered whole (in a buffer of its own when larger than the slab).
            out.append(_Piece(name, flat, 0, numel, selection))
            continue
        per = max(1, buffer_bytes // max(1, itemsize))
        start = 0
        while True:
            stop = min(numel, start + per)
            out.append(_Piece(name, flat, start, stop, None))
            start = stop
            if start >= numel:
                break
    return out


def _gather(
    file: TensorFile,
    items: list[Item],
    pool: StagingPool,
    stream: torch.cuda.Stream | None,
    threads: int | None,
    progress: _core.Progress | None,
) -> int:
    """The engine gathers (and converts) pieces into one half of the slab while the copies out of
    the other half run; returns destination bytes written."""
    cuda = stream is not None
    slab = pool.slab(pinned=cuda).data
    half = slab.numel() // 2 // SLOT_UNIT * SLOT_UNIT  # the second half aligned as the first
    halves = [slab[:half], slab[half : 2 * half]]
    events: list[torch.cuda.Event | None] = [None, None]
    pieces = _pieces(items, half)
    transient: list[Slab] = []
    written = 0
    turn = 0
    i = 0
    while i < len(pieces):
        event = events[turn % 2]
        if event is not None:
            event.synchronize()  # the copy out of this half must finish before it is refilled
        buf = halves[turn % 2]
        # Pack as many pieces as fit, each at an offset aligned for its dtype (and 64 bytes).
        batch: list[tuple[_Piece, int, int]] = []
        offset = 0
        while i < len(pieces):
            p = pieces[i]
            nbytes = (p.stop - p.start) * p.dest.element_size()
            offset = (offset + 63) & ~63
            if batch and offset + nbytes > half:
                break
            batch.append((p, offset, nbytes))
            offset += nbytes
            i += 1
        if offset > half:
            # One slice larger than half the slab: gathered in a buffer of its own, kept alive
            # until the stream is synchronized.
            own = pool.transient(offset, pinned=cuda)
            transient.append(own)
            buf = own.data
        jobs = []
        for p, off, nbytes in batch:
            sel = p.selection if p.selection is not None or p.whole else [p.start, p.stop]
            jobs.append((p.name, buf[off : off + nbytes], to_st(p.dest.dtype), sel))
        copy_into(file, jobs, threads, progress)
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            for p, off, nbytes in batch:
                src = buf[off : off + nbytes].view(p.dest.dtype)
                p.dest[p.start : p.stop].copy_(src, non_blocking=cuda)
                written += nbytes
            if stream is not None:
                events[turn % 2] = torch.cuda.Event()
                events[turn % 2].record(stream)  # type: ignore[union-attr]
        turn += 1
    if stream is not None:
        stream.synchronize()
    return written


__all__ = ["Item", "stream_into"]
