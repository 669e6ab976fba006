"""After vLLM's post-load processing: unmap the checkpoint pages no parameter uses any more.

A mapping stays alive while any view of it does (an embedding kept as stored, a norm), and with
it every page of the file that was read into it, though vLLM's post-load processing replaced most
parameters (on CPU it repacks every linear weight for oneDNN and drops the original). Those pages
would count in the server's resident memory for nothing. :func:`release_unused` drops them from
this process's page tables (``MADV_DONTNEED``): they stay in the page cache, shared and
reclaimable, and a later access (nothing should make one) maps them again from the file. Pages
that were written since (copy-on-write, private to this process) are kept: dropping them would
lose the writes.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fastload.core.memory.sharing import SharedMapping

_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = 4
_FILE = 1 << 61


@dataclass(frozen=True)
class MappingRecord:
    """A mapping a load handed views of, without keeping it alive."""

    alive: weakref.ref[Any]  # the storage that owns the mapping
    address: int
    size: int

    @classmethod
    def of(cls, mapping: SharedMapping) -> MappingRecord:
        return cls(weakref.ref(mapping._pages.owner), mapping.address, mapping.file.file_size)


def _private_pages(start: int, stop: int) -> torch.Tensor:
    """Which pages of ``[start, stop)`` are present and not file pages (written: copy-on-write),
    from ``/proc/self/pagemap``; all of them where it cannot be read."""
    n = (stop - start) // _PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            raw = os.pread(fd, 8 * n, start // _PAGE * 8)
        finally:
            os.close(fd)
        entries = torch.frombuffer(bytearray(raw), dtype=torch.int64)
    except OSError:
        return torch.ones(n, dtype=torch.bool)
    present = (entries & -(1 << 63)) != 0  # bit 63, the sign bit of an int64
    file = (entries & _FILE) != 0
    return present & ~file


def release_unused(records: Iterable[MappingRecord], tensors: Iterable[torch.Tensor]) -> int:
    """Drops from the page tables the pages of the still-alive mappings in ``records`` that no
    tensor of ``tensors`` (the model's parameters and buffers) lies on; returns the bytes of the
    ranges dropped (mapped or not)."""
    records = [r for r in records if r.alive() is not None]
    if not records:
        return 0
    spans = [
        (t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes())
        for t in tensors
        if t.device.type == "cpu" and t.numel()
    ]
    libc = ctypes.CDLL(None, use_errno=True)
    dropped = 0
    for r in records:
        begin = -(-r.address // _PAGE) * _PAGE
        end = (r.address + r.size) // _PAGE * _PAGE
        keep = sorted(
            (max(a // _PAGE * _PAGE, begin), min(-(-b // _PAGE) * _PAGE, end))
            for a, b in spans
            if a < r.address + r.size and b > r.address
        )
        holes: list[tuple[int, int]] = []
        at = begin
        for a, b in keep:
            if a > at:
                holes.append((at, a))
            at = max(at, b)
        if at < end:
            holes.append((at, end))
        for a, b in holes:
            private = _private_pages(a, b)
            run = a
            # split the hole around written pages, which must stay
            for i in [*private.nonzero().flatten().tolist(), (b - a) // _PAGE]:
                stop = a + i * _PAGE
                if stop > run:
                    libc.madvise(ctypes.c_void_p(run), ctypes.c_size_t(stop - run), _MADV_DONTNEED)
                    dropped += stop - run
                run = stop + _PAGE
    return dropped


__all__ = ["MappingRecord", "release_unused"]
