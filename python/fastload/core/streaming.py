"""The staged copy pipeline: file -> bounded staging buffers -> destination device.

For accelerator destinations (CUDA), the Rust engine fills one *pinned* host buffer while the
host-to-device copy of the previous buffer runs on a side stream (double buffering). Peak host
memory is the pool size (``num_buffers * buffer_bytes``), not the model size. The same code runs
with CPU destinations (plain buffers, synchronous copies), which is how it is tested on machines
without a GPU.

One :class:`StagingPool` serves a whole load: ``from_pretrained`` creates one per call and hands it
to every file and device, and a ``safe_open`` handle keeps one for its lifetime. Its buffers are
allocated on first use, so a load that stages nothing allocates nothing, and pinning
(``cudaHostAlloc``, tens of milliseconds for 128 MiB) is paid once per load instead of once per
shard, device or tensor.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from fastload import _core
from fastload.core.dtypes import to_st
from fastload.core.engine import TensorFile, copy_into
from fastload.core.errors import RequestError
from fastload.core.units import MAX_BYTES, parse_bytes

#: Size of one staging buffer: large enough that a host-to-device copy runs at full bandwidth,
#: small enough that two of them are negligible next to a model.
DEFAULT_BUFFER_BYTES = 64 << 20
#: Two buffers: Rust fills one while the other's host-to-device copy runs.
DEFAULT_NUM_BUFFERS = 2
#: The default pool size (``staging_bytes`` of ``from_pretrained`` / ``load_file`` / ``safe_open``).
DEFAULT_STAGING_BYTES = DEFAULT_BUFFER_BYTES * DEFAULT_NUM_BUFFERS
# Below this a buffer would turn the copy into many tiny host-to-device transfers.
_MIN_BUFFER_BYTES = 64


def max_staging_bytes() -> int:
    """The largest ``staging_bytes``: the machine's physical memory (the pool is host memory,
    pinned for a GPU; more can never be allocated), or :data:`fastload.core.units.MAX_BYTES` where
    the operating system does not say."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return MAX_BYTES
    return min(physical, MAX_BYTES) if physical > 0 else MAX_BYTES


@dataclass
class _Piece:
    name: str
    dest: torch.Tensor  # flat view of the destination
    start: int  # first element (of the flattened tensor)
    stop: int
    selection: list[int] | None  # None for whole-tensor reads in one piece


class _Buffer:
    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
        self.event: torch.cuda.Event | None = None

    def wait(self) -> None:
        # The previous host-to-device copy out of this buffer must finish before it is refilled.
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class StagingPool:
    """The staging buffers of one load: ``num_buffers`` buffers of ``buffer_bytes`` each, pinned
    when they feed a CUDA device, allocated on first use and reused by every staged copy.

    Host memory stays at ``num_buffers * buffer_bytes`` for the whole load, plus, transiently, one
    buffer for a single tensor-parallel slice larger than a pool buffer (a slice is staged whole).
    Not thread-safe: one pool per load, used by one thread.
    """

    def __init__(
        self, buffer_bytes: int = DEFAULT_BUFFER_BYTES, num_buffers: int = DEFAULT_NUM_BUFFERS
    ) -> None:
        for name, value, low in (
            ("buffer_bytes", buffer_bytes, _MIN_BUFFER_BYTES),
            ("num_buffers", num_buffers, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RequestError(f"staging {name} must be an int >= {low}, got {value!r}")
        self.buffer_bytes = buffer_bytes
        self.num_buffers = num_buffers
        self._buffers: list[_Buffer] = []
        self._pinned = False
        self._turn = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        #: how many buffers this pool has allocated (pinned or not), for reports and tests
        self.allocations = 0
        #: the most host bytes the pool held at once (oversize buffers included)
        self.peak_bytes = 0

    @classmethod
    def sized(cls, staging_bytes: int | str | None) -> StagingPool:
        """A pool of :data:`DEFAULT_NUM_BUFFERS` buffers sharing ``staging_bytes`` (an int or a
        size string such as ``"256MiB"``; ``None``: :data:`DEFAULT_STAGING_BYTES`), at most
        :func:`max_staging_bytes` (``RequestError`` naming ``staging_bytes`` otherwise)."""
        if staging_bytes is None:
            return cls()
        total = parse_bytes(
            staging_bytes,
            where="staging_bytes",
            positive=True,
            maximum=max_staging_bytes(),
            bound="the memory of this machine (the pool is host memory)",
        )
        per = total // DEFAULT_NUM_BUFFERS
        if per < _MIN_BUFFER_BYTES:
            raise RequestError(
                f"staging_bytes must be at least {_MIN_BUFFER_BYTES * DEFAULT_NUM_BUFFERS} bytes, "
                f"got {staging_bytes!r}"
            )
        return cls(per, DEFAULT_NUM_BUFFERS)

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds now (0 before first use)."""
        return sum(b.data.numel() for b in self._buffers)

    def next_buffer(self, pinned: bool) -> _Buffer:
        """The next buffer in turn, once the copy out of it has finished."""
        if not self._buffers or (pinned and not self._pinned):
            # First use, or a CUDA destination after CPU-only staging: (re)allocate, pinned if
            # needed. Pinned buffers also serve CPU destinations, so this happens at most twice.
            self.synchronize()
            self._buffers = [_Buffer(self.buffer_bytes, pinned) for _ in range(self.num_buffers)]
            self._pinned = pinned
            self.allocations += self.num_buffers
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
        buf = self._buffers[self._turn % len(self._buffers)]
        self._turn += 1
        buf.wait()
        return buf

    def oversize_buffer(self, nbytes: int, pinned: bool) -> _Buffer:
        """A buffer of its own for one piece larger than a pool buffer (freed by the caller)."""
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes + nbytes)
        return _Buffer(nbytes, pinned)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` for this load (created once)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def synchronize(self) -> None:
        """Waits for every copy out of the pool's buffers."""
        for buf in self._buffers:
            buf.wait()

    def release(self) -> None:
        """Frees the buffers (after waiting for their copies); the pool can be used again."""
        self.synchronize()
        self._buffers = []
        self._pinned = False


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
    file: TensorFile,
    items: list[tuple[str, torch.Tensor, list[int] | None]],
    *,
    pool: StagingPool | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    threads: int | None = None,
    progress: _core.Progress | None = None,
) -> int:
    """Fills destination tensors (any device, one device per call) through staging buffers.

    Pieces of consecutive tensors are packed into each buffer; one Rust call fills a buffer
    (validated first, GIL released), then each piece is copied to its destination, asynchronously
    on a side stream for CUDA destinations. The buffers are ``pool``'s (shared by the calls of one
    load), or a pool of ``num_buffers`` x ``buffer_bytes`` made for this call. Returns destination
    bytes written; every destination is filled when it returns.
    """
    if not items:
        return 0
    devices = {t.device for _, t, _ in items}
    if len(devices) != 1:
        raise RequestError(f"stream_into takes one destination device per call, got {devices}")
    device = devices.pop()
    cuda = device.type == "cuda"
    if pool is None:
        pool = StagingPool(buffer_bytes, num_buffers)
    stream = pool.stream(device) if cuda else None
    if stream is not None:
        # Destinations were allocated on the current stream; writes on the side stream must not
        # overtake work still queued there on memory the caching allocator handed out again.
        stream.wait_stream(torch.cuda.current_stream(device))
    pieces = _pieces(items, pool.buffer_bytes)
    oversize: list[_Buffer] = []
    written = 0
    i = 0
    while i < len(pieces):
        buf = pool.next_buffer(pinned=cuda)
        # Pack as many pieces as fit, each at an offset aligned for its dtype (and 64 bytes).
        batch: list[tuple[_Piece, int, int]] = []
        offset = 0
        while i < len(pieces):
            p = pieces[i]
            nbytes = (p.stop - p.start) * p.dest.element_size()
            offset = (offset + 63) & ~63
            if batch and offset + nbytes > pool.buffer_bytes:
                break
            batch.append((p, offset, nbytes))
            offset += nbytes
            i += 1
        if offset > pool.buffer_bytes:
            # One slice larger than a pool buffer: stage it in a buffer of its own, kept alive
            # until the stream is synchronized below.
            buf = pool.oversize_buffer(offset, pinned=cuda)
            oversize.append(buf)
        jobs = []
        for p, off, nbytes in batch:
            sel = p.selection if p.selection is not None else [p.start, p.stop]
            jobs.append((p.name, buf.data[off : off + nbytes], to_st(p.dest.dtype), sel))
        copy_into(file, jobs, threads, progress)
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
