"""The staging memory of accelerator loads: a ring of slots the engine reads file bytes into and
the host-to-device copies read out of.

One :class:`StagingPool` serves a whole load (``from_pretrained`` makes one per call; a
``safe_open`` handle keeps one for its lifetime): ``staging_bytes`` cut into :attr:`num_slots`
slots of :attr:`slot_bytes`. Its memory (one *slab*) is taken on first use, so a load that stages
nothing takes nothing. A pinned slab (``cudaHostAlloc``, which costs about as much as copying the
same bytes) is made once and kept for the process: when a pool is released its pinned slab goes to
a process-wide cache and the next load that fits in it takes it again instead of pinning anew
(:func:`free_staging_memory` gives it back). Unpinned slabs (CPU destinations: tests and the
benchmark of this path) are freed with their pool.
"""

from __future__ import annotations

import os
import threading

import torch

from fastload import _core
from fastload.core.basics.errors import RequestError
from fastload.core.basics.units import MAX_BYTES, parse_bytes

#: One slot: large enough that a host-to-device copy runs at full bandwidth and that the reads of
#: one slot spread over several threads, small enough that a ring of many fits a modest pool.
DEFAULT_SLOT_BYTES = 16 << 20
#: Sixteen slots: enough fills read ahead to keep hundreds of MiB of reads in flight while the
#: copies out of the oldest ones run.
DEFAULT_NUM_SLOTS = 16
#: The default pool size (``staging_bytes`` of ``from_pretrained`` / ``load_file`` / ``safe_open``).
DEFAULT_STAGING_BYTES = DEFAULT_SLOT_BYTES * DEFAULT_NUM_SLOTS
#: A ring needs one slot being read while another is copied out of; four keep both sides busy.
MIN_SLOTS = 4
#: Every slot is a whole multiple of this many bytes, so that each starts aligned for any dtype
#: (torch views a slot's bytes as the tensor's dtype only at a multiple of its element size) and
#: for the 64-byte packing of gathered pieces; it is also the smallest slot (below it the copy
#: would be many tiny host-to-device transfers).
SLOT_UNIT = 64
#: Alignment of slots that direct reads (past the page cache) can fill: offset, length and address.
ALIGN: int = _core.STAGE_ALIGN


def max_staging_bytes() -> int:
    """The largest ``staging_bytes``: the machine's physical memory (the pool is host memory,
    pinned for a GPU; more can never be allocated), or :data:`fastload.core.basics.units.MAX_BYTES`
    where the operating system does not say."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return MAX_BYTES
    return min(physical, MAX_BYTES) if physical > 0 else MAX_BYTES


class Slab:
    """One allocation cut into slots: ``nbytes`` usable bytes starting at an :data:`ALIGN`-ed
    address (pinned slabs are page-aligned already; plain ones are over-allocated and offset)."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        extra = 0 if pinned else ALIGN
        self._memory = torch.empty(nbytes + extra, dtype=torch.uint8, pin_memory=pinned)
        start = (-self._memory.data_ptr()) % ALIGN if extra else 0
        #: the usable bytes, aligned
        self.data = self._memory[start : start + nbytes]
        self.pinned = pinned

    @property
    def nbytes(self) -> int:
        return self.data.numel()


_cache_lock = threading.Lock()
#: the process's idle pinned slab (at most one: the largest a pool gave back)
_idle_pinned: Slab | None = None


def _take_pinned(nbytes: int) -> Slab | None:
    global _idle_pinned
    with _cache_lock:
        slab = _idle_pinned
        if slab is not None and slab.nbytes >= nbytes:
            _idle_pinned = None
            return slab
    return None


def _keep_pinned(slab: Slab) -> None:
    global _idle_pinned
    with _cache_lock:
        if _idle_pinned is None or _idle_pinned.nbytes < slab.nbytes:
            _idle_pinned = slab


def free_staging_memory() -> int:
    """Frees the pinned staging memory the process keeps between accelerator loads; returns the
    bytes freed (0 if none was kept). The next accelerator load pins its pool anew."""
    global _idle_pinned
    with _cache_lock:
        slab, _idle_pinned = _idle_pinned, None
    return slab.nbytes if slab is not None else 0


class StagingPool:
    """The staging slots of one load: ``num_slots`` slots of ``slot_bytes`` each, in one slab
    taken on first use (pinned when it feeds a CUDA device, reused from the process's cache when
    one fits), given back by :meth:`release`.

    Host memory stays at ``num_slots * slot_bytes`` for the whole load, plus, transiently, one
    buffer for a single tensor-parallel slice that must be gathered and is larger than the slab.

    A pool may be shared between threads (a ``safe_open`` handle's pool is): a staged copy holds
    it (:meth:`in_use`) from its first read into a slot to its last copy out of one, and a copy
    from another thread waits until then, as :meth:`release` does. The copies through one pool
    run one at a time, whichever threads run them.
    """

    def __init__(
        self, slot_bytes: int = DEFAULT_SLOT_BYTES, num_slots: int = DEFAULT_NUM_SLOTS
    ) -> None:
        for name, value, low in (
            ("slot_bytes", slot_bytes, SLOT_UNIT),
            ("num_slots", num_slots, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RequestError(f"staging {name} must be an int >= {low}, got {value!r}")
        if slot_bytes % SLOT_UNIT:
            raise RequestError(
                f"staging slot_bytes must be a multiple of {SLOT_UNIT} (a slot starts aligned for "
                f"every dtype), got {slot_bytes!r}"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        # Reentrant: a copy holding the pool releases and takes the slab again (pinned after
        # plain) under it.
        self._lock = threading.RLock()
        self._slab: Slab | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        #: slabs this pool allocated (not taken from the process cache), for reports and tests
        self.allocations = 0
        #: the most host bytes the pool held at once (a transient gather buffer included)
        self.peak_bytes = 0
        #: bytes the engine read into the slots past the page cache (direct I/O), and through it
        self.direct_bytes = 0
        self.cached_bytes = 0

    @classmethod
    def sized(cls, staging_bytes: int | str | None) -> StagingPool:
        """A pool of at most ``staging_bytes`` (an int or a size string such as ``"256MiB"``;
        ``None``: :data:`DEFAULT_STAGING_BYTES`), at most :func:`max_staging_bytes`
        (``RequestError`` naming ``staging_bytes`` otherwise): slots of
        :data:`DEFAULT_SLOT_BYTES`, smaller where that leaves fewer than :data:`MIN_SLOTS`.

        A slot is a whole multiple of :data:`ALIGN` where it can be (from ``4 * ALIGN`` bytes on,
        so that cold ranges are read past the page cache), of :data:`SLOT_UNIT` below that (so
        that it starts aligned for every dtype); the pool is ``staging_bytes`` rounded down to
        whole slots. Less than ``MIN_SLOTS * SLOT_UNIT`` (256 bytes) is refused, saying so."""
        if staging_bytes is None:
            return cls()
        total = parse_bytes(
            staging_bytes,
            where="staging_bytes",
            positive=True,
            maximum=max_staging_bytes(),
            bound="the memory of this machine (the pool is host memory)",
        )
        slot = min(DEFAULT_SLOT_BYTES, total // MIN_SLOTS)
        slot -= slot % (ALIGN if slot >= ALIGN else SLOT_UNIT)
        if slot < SLOT_UNIT:
            raise RequestError(
                f"staging_bytes must be at least {SLOT_UNIT * MIN_SLOTS} bytes "
                f"({MIN_SLOTS} slots of {SLOT_UNIT}), got {staging_bytes!r}"
            )
        return cls(slot, total // slot)

    def in_use(self) -> threading.RLock:
        """The pool's lock, held by a staged copy for as long as it uses the slots (``with
        pool.in_use(): ...``): the slots hold one copy's bytes at a time."""
        return self._lock

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds now (0 before first use)."""
        return self._slab.nbytes if self._slab is not None else 0

    @property
    def pinned(self) -> bool:
        """Whether the pool's slab is pinned (page-locked for device copies)."""
        return self._slab is not None and self._slab.pinned

    def slab(self, pinned: bool) -> Slab:
        """The pool's slab, taken on first use (pinned if asked: a CUDA destination after
        CPU-only staging takes a pinned one; pinned slabs also serve CPU destinations)."""
        if self._slab is None or (pinned and not self._slab.pinned):
            self.release()
            size = self.slot_bytes * self.num_slots
            slab = _take_pinned(size) if pinned else None
            if slab is None:
                slab = Slab(size, pinned)
                self.allocations += 1
            self._slab = slab
            self.peak_bytes = max(self.peak_bytes, slab.nbytes)
        return self._slab

    def slot_addresses(self, pinned: bool) -> list[int]:
        """The address of each slot of the pool's slab."""
        base = self.slab(pinned).data.data_ptr()
        return [base + i * self.slot_bytes for i in range(self.num_slots)]

    def slot(self, i: int) -> torch.Tensor:
        """Slot ``i`` of the slab as bytes."""
        assert self._slab is not None, "slot() before slab()"
        return self._slab.data[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def transient(self, nbytes: int, pinned: bool) -> Slab:
        """A buffer of its own for one gathered piece larger than the slab (freed by the
        caller), counted in :attr:`peak_bytes`."""
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.nbytes + nbytes)
        return Slab(nbytes, pinned)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` for this load (created once)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def synchronize(self) -> None:
        """Waits for every copy this pool's streams queued."""
        for stream in self._streams.values():
            stream.synchronize()

    def release(self) -> None:
        """Gives the slab back (after the copies out of it finished): a pinned one to the
        process's cache, a plain one to the allocator. The pool can be used again. Waits for a
        copy another thread runs through the pool."""
        with self._lock:
            self.synchronize()
            slab, self._slab = self._slab, None
        if slab is not None and slab.pinned:
            _keep_pinned(slab)


__all__ = [
    "DEFAULT_NUM_SLOTS",
    "DEFAULT_SLOT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "SLOT_UNIT",
    "StagingPool",
    "free_staging_memory",
    "max_staging_bytes",
]
