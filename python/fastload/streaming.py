"""The staged copy pipeline: file -> bounded staging buffers -> destination device.

For accelerator destinations (CUDA), the Rust engine fills one *pinned* host buffer while the
host-to-device copy of the previous buffer runs on a side stream (double buffering). Peak host
memory is the pool size (``num_buffers * buffer_bytes``), not the model size. The same code runs
with CPU destinations (plain buffers, synchronous copies), which is how it is tested on machines
without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fastload import _core
from fastload.dtypes import to_st
from fastload.errors import RequestError

DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_NUM_BUFFERS = 2


@dataclass
class _Piece:
    name: str
    dest: torch.Tensor  # flat view of the destination
    start: int  # first element (of the flattened tensor)
    stop: int
    selection: list[int] | None  # None for whole-tensor reads in one piece


class _Buffer:
    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.event: torch.cuda.Event | None = None

    def wait(self) -> None:
        # The previous host-to-device copy out of this buffer must finish before it is refilled.
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def _pieces(
    items: list[tuple[str, torch.Tensor, list[int] | None]], buffer_bytes: int
) -> list[_Piece]:
    out: list[_Piece] = []
    for name, dest, selection in items:
        if not dest.is_contiguous():
            raise RequestError(f"tensor {name!r}: staged destinations must be contiguous")
        numel, itemsize = dest.numel(), dest.element_size()
        flat = dest.view(-1)
        if selection is not None:
            # A slice is staged whole (in a buffer of its own when larger than the pool's).
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


def stream_into(
    file: _core.SafetensorsFile,
    items: list[tuple[str, torch.Tensor, list[int] | None]],
    *,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    threads: int | None = None,
    progress: _core.Progress | None = None,
) -> int:
    """Fills destination tensors (any device, one device per call) through staging buffers.

    Pieces of consecutive tensors are packed into each buffer; one Rust call fills a buffer
    (validated first, GIL released), then each piece is copied to its destination, asynchronously
    on a side stream for CUDA destinations. Returns destination bytes written.
    """
    if not items:
        return 0
    devices = {t.device for _, t, _ in items}
    if len(devices) != 1:
        raise RequestError(f"stream_into takes one destination device per call, got {devices}")
    device = devices.pop()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    if stream is not None:
        # Destinations were allocated on the current stream; writes on the side stream must not
        # overtake work still queued there on memory the caching allocator handed out again.
        stream.wait_stream(torch.cuda.current_stream(device))
    pool = [_Buffer(buffer_bytes, pinned=cuda) for _ in range(max(1, num_buffers))]
    pieces = _pieces(items, buffer_bytes)
    oversize: list[_Buffer] = []
    written = 0
    turn = 0
    i = 0
    while i < len(pieces):
        buf = pool[turn % len(pool)]
        turn += 1
        buf.wait()
        # Pack as many pieces as fit, each at an offset aligned for its dtype (and 64 bytes).
        batch: list[tuple[_Piece, int, int]] = []
        offset = 0
        while i < len(pieces):
            p = pieces[i]
            nbytes = (p.stop - p.start) * p.dest.element_size()
            offset = (offset + 63) & ~63
            if batch and offset + nbytes > buffer_bytes:
                break
            batch.append((p, offset, nbytes))
            offset += nbytes
            i += 1
        if offset > buffer_bytes:
            # One slice larger than a pool buffer: stage it in a buffer of its own, kept alive
            # until the stream is synchronized below.
            buf = _Buffer(offset, pinned=cuda)
            oversize.append(buf)
        base = buf.data.data_ptr()
        jobs = []
        for p, off, nbytes in batch:
            sel = p.selection if p.selection is not None else [p.start, p.stop]
            jobs.append((p.name, base + off, nbytes, to_st(p.dest.dtype), sel))
        file.copy_into(jobs, threads, progress)
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            for p, off, nbytes in batch:
                src = buf.data[off : off + nbytes].view(p.dest.dtype)
                p.dest[p.start : p.stop].copy_(src, non_blocking=cuda)
                written += nbytes
            if stream is not None:
                buf.event = torch.cuda.Event()
                buf.event.record(stream)
    if stream is not None:
        stream.synchronize()
    return written
