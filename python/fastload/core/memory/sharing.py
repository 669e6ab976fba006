"""Zero-copy loading: CPU tensors that are views of a private mapping of the checkpoint.

``from_pretrained(..., mmap=...)`` decides per file (:func:`file_sharing`):

* ``"auto"`` (default): views when the file sits on a local filesystem; private copies on network,
  cluster and FUSE filesystems (NFS, SMB/CIFS, Lustre, 9p, Ceph, GPFS, FUSE...), where each page
  fault is a round trip and an unreachable server or a file changed on another host turns a memory
  access into SIGBUS.
* ``"shared"``: views wherever the file is (the caller vouches for the filesystem).
* ``"copy"``: private copies, read with ``read_mode``.

A tensor becomes a view when it is whole, goes to the CPU, its stored dtype is the wanted one and
its file offset is aligned for it; anything else (dtype conversion, accelerator destinations,
tensor-parallel shards, misaligned offsets) is copied as usual. A view is a slice of one
``MAP_PRIVATE`` mapping of the file: until a page is written it *is* the page-cache page, so N
worker processes that load the same checkpoint share one physical copy; a write copies just that
page (copy-on-write) and never reaches the file.

From the moment a file is open, a helper thread (:class:`WarmUp`) reads its pages in parallel and
maps them into the mapping the views come from, while the skeleton is built: a cold load runs at
the disk's bandwidth instead of one page fault at a time on first use, and a warm one returns
with its pages mapped.

Hazard: a file truncated or rewritten in place while mapped makes access to the lost pages raise
SIGBUS and kill the process. Replace checkpoints by writing a new file and renaming it (as
``fastload.save_pretrained`` does), never in place; or load with ``mmap="copy"``.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import to_torch, torch_shape
from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    FastloadIOError,
    RequestError,
)
from fastload.core.basics.units import format_bytes
from fastload.core.memory import paced as pacing
from fastload.core.memory.budget import MemoryBudget, memory_budget

#: The accepted values of ``from_pretrained(mmap=...)``.
MMAP_MODES = ("auto", "shared", "copy")

#: whether views that do not fit the budget are read ahead paced by the first forward
#: (:mod:`fastload.core.memory.paced`) rather than only the first ones that fit
PACED = True

#: the order views are handed out across every mapping (a load makes them in the model's
#: registration order: the order its first forward uses them)
_view_order = itertools.count()

#: bytes of a cached file the warm-up maps per claim (its helper thread and the loading thread
#: share them out)
WARM_PIECE = 64 << 20


def check_mmap_mode(mmap: str) -> None:
    """Raises ``RequestError`` unless ``mmap`` is one of :data:`MMAP_MODES`."""
    if mmap not in MMAP_MODES:
        raise RequestError(f"mmap must be one of {', '.join(map(repr, MMAP_MODES))}, got {mmap!r}")


def filesystem(file: _core.SafetensorsFile) -> tuple[str, bool] | None:
    """``(name, local)`` of the filesystem ``file`` is on (``SafetensorsFile.filesystem``)."""
    return file.filesystem()


def file_sharing(file: object, mmap: str) -> tuple[bool, str]:
    """Whether tensors of ``file`` (an opened checkpoint file) may be views of its mapping under
    ``mmap``, and why, in words for the load report."""
    if mmap == "copy":
        return False, "copies (mmap='copy')"
    if not isinstance(file, _core.SafetensorsFile):
        return False, "copies (not a safetensors file: no layout to map)"
    if file.remote:
        return False, "copies (object storage: read with ranged GETs, no file to map)"
    fs = filesystem(file)
    if fs is None:
        return False, "copies (file held in memory)"
    name, local = fs
    if mmap == "auto" and not local:
        return False, f"copies ({name} is a network or FUSE filesystem)"
    return True, f"views of the file mapping ({name})"


class SharedMapping:
    """A private (copy-on-write) mapping of one safetensors file, handing out tensor views.

    Each view gets a storage of its own bytes (a window of the mapping that keeps the mapping
    alive), as if it had been allocated alone: ``torch.save`` or pickling one parameter writes
    that parameter, not the whole checkpoint; ``share_memory_()`` moves that parameter alone;
    safetensors' ``save_model`` sees separate tensors. The mapping is unmapped when its last
    view is freed."""

    def __init__(self, file: _core.SafetensorsFile) -> None:
        self.file = file
        self.path = file.path
        # torch maps by path. On Linux the path of the open file descriptor names exactly the file
        # whose header Rust validated, even if the checkpoint was replaced (or deleted) since.
        # Elsewhere the path must still name that file (a checkpoint replaced by rename would
        # otherwise mix two files), before and after.
        fd = file.fileno()
        by_fd = f"/proc/self/fd/{fd}" if fd is not None else None
        # shared=False maps the file MAP_PRIVATE: reads share the page cache, writes stay private.
        if by_fd is not None and os.path.exists(by_fd):
            storage = torch.UntypedStorage.from_file(by_fd, False, file.file_size)
        else:
            self._check_same_file()
            storage = torch.UntypedStorage.from_file(self.path, False, file.file_size)
            self._check_same_file()
        #: address of the first byte of the mapping
        self.address: int = storage.data_ptr()
        # The mapping as a writable buffer for torch.frombuffer, whose storages hold a reference
        # to it (and it to the mapping's owner): one storage per view, zero-copy.
        self._pages = _pages(file.file_size, self.address, storage)
        self._info = {name: (dt, shape, begin) for name, dt, shape, begin, _ in file.tensors()}
        # (order, file offset, bytes) of the views handed out
        self._viewed: list[tuple[int, int, int]] = []
        self.views = 0

    def _check_same_file(self) -> None:
        st = os.stat(self.path)
        if (st.st_dev, st.st_ino) != self.file.identity() or st.st_size != self.file.file_size:
            raise CheckpointError(
                f"{self.path}: [file-changed] the path no longer names the file that was opened "
                f"and validated ({self.file.file_size} bytes); it was replaced or resized while "
                f"loading (now {st.st_size} bytes)"
            )

    def view(self, name: str, dtype: torch.dtype, *, track: bool = True) -> torch.Tensor | None:
        """A view of tensor ``name`` if it can be shared as ``dtype``; ``None`` if it must be copied
        (different dtype, or an offset not aligned for the element size). ``track=False`` leaves
        it out of :meth:`prefetch` and the count of views (a disk-offloaded tensor, viewed anew
        each time its module runs)."""
        st_dtype, header_shape, begin = self._info[name]
        where = f"{self.path}: tensor {name!r}"
        stored = to_torch(st_dtype, where=where)
        # the tensor torch makes of the bytes (a packed dtype's header counts values)
        shape = torch_shape(st_dtype, header_shape, where=where)
        if stored != dtype:
            return None
        offset = self.file.data_start + begin
        itemsize = dtype.itemsize
        if offset % itemsize:
            return None
        count = math.prod(shape)
        # explicitly on the CPU, where the mapping is: an ambient device context
        # (``with torch.device("meta")``, ``torch.set_default_device``) must not leak in
        out = torch.empty(0, dtype=dtype, device="cpu")
        if count:  # frombuffer refuses an empty window; an empty tensor needs no bytes anyway
            window = torch.frombuffer(self._pages, dtype=dtype, count=count, offset=offset)
            out.set_(window.untyped_storage(), 0, tuple(shape))
        else:
            out.resize_(tuple(shape))
        if track:
            self._viewed.append((next(_view_order), offset, count * itemsize))
            self.views += 1
        return out

    def prefetch(self, threads: int | None = None, budget: MemoryBudget | None = None) -> int:
        """Reads the pages of the views handed out that are not in the page cache yet, with
        parallel read-ahead (the disk's bandwidth, not one fault at a time on first use); returns
        the bytes read. Cached pages are left to be mapped on first access, which costs about as
        much as mapping them here. Within ``budget`` (default:
        :func:`~fastload.core.memory.budget.memory_budget` now), in the order the views were handed
        out: :func:`prefetch_in_order`."""
        return prefetch_in_order([self], budget or memory_budget(), threads)[0]

    def map_all(self) -> int:
        """Maps every page of the file's tensor data into this mapping, read through the page
        cache first (``sendfile``, then ``MADV_POPULATE_READ``); returns the bytes populated. Run by
        :class:`WarmUp` beside the skeleton build for a file mostly not cached (a cached one is
        mapped in pieces, :meth:`map_span`), so the views' first use finds its pages mapped
        instead of faulting them in one by one on the caller's critical path."""
        spans = [(self.file.data_start, self.file.file_size)]
        return self._populate(spans, None, cached=True, cold=True)

    def map_span(self, start: int, stop: int) -> int:
        """Maps the pages of file bytes ``[start, stop)`` into this mapping, from one thread where
        they are mostly cached (CPU work only), else from parallel ones (the disk's); returns the
        bytes populated."""
        cold = self.file.mostly_uncached(start, stop - start)
        return self._populate([(start, stop)], None if cold else 1, cached=True, cold=cold)

    def _populate(
        self, spans: list[tuple[int, int]], threads: int | None, *, cached: bool, cold: bool
    ) -> int:
        base = self.address
        done = 0
        try:
            for start, stop in spans:
                done += self.file.read_ahead(
                    base + start, start, stop - start, threads=threads, cached=cached, cold=cold
                )
        except FastloadIOError as e:
            self._check_same_file()  # a file cut short under the mapping says so
            raise FastloadIOError(f"reading ahead the mapped file failed: {e}") from e
        return done


class WarmUp:
    """Read-ahead of the files a load will map, started in a helper thread as soon as they are
    open: the pages are read from the disk and mapped into the load's mappings
    (:meth:`SharedMapping.map_all`) while the model skeleton is built and the load planned,
    instead of after it or on the first forward pass.

    A file mostly not in the page cache is read into it and mapped by 8 threads (the disk serves
    parallel requests best), through the read path (``sendfile`` to /dev/null), which caches
    large folios that this and every later mapping of the file maps fast (``WILLNEED`` left
    4 KiB ones). A cached file is mapped in :data:`WARM_PIECE` pieces, by the helper thread and,
    once the load has nothing else to do, by the loading thread too (:meth:`join`): mapping costs
    up to ~60 ms per GiB here (4 KiB page-cache folios; 2 MiB ones map with one entry each, ~10x
    faster).

    Only for loads whose tensors become views (``views``: CPU, stored dtype) of files
    :func:`file_sharing` lets be mapped: copies read the file themselves, and a second stream of
    reads beside theirs made cold copies 9% and bf16 -> f32 conversions 19% slower here. Skipped
    when the files do not fit the read-ahead room of ``budget`` (the memory the process may use,
    its cgroup's limit included: :func:`fastload.core.memory.budget.memory_budget`): pages read
    ahead would evict each other before their first use, and the first forward would read them all
    again. The load then reads ahead what fits, in the order the model uses it
    (:func:`prefetch_in_order`).

    The whole tensor data of each file is mapped, tensors the model does not use included: those
    are clean page-cache pages shared with other processes, which the kernel reclaims under
    pressure; resident memory stays within the file's size."""

    def __init__(
        self, files: Sequence[object], mmap: str, *, views: bool, budget: MemoryBudget | None = None
    ) -> None:
        chosen = {i: f for i, f in enumerate(files) if views and file_sharing(f, mmap)[0]}
        budget = budget or memory_budget()
        if not budget.fits_read_ahead(sum(f.file_size - f.data_start for f in chosen.values())):
            chosen = {}
        #: the mappings the load's views come from, by index in ``files``
        self.mappings: dict[int, SharedMapping] = {
            i: SharedMapping(f) for i, f in chosen.items() if isinstance(f, _core.SafetensorsFile)
        }
        self.from_disk = 0  # tensor bytes of the files mostly not cached when the load began
        # Pieces of cached files, claimed by the helper thread and, in join(), the loading one;
        # listed by the helper (asking the page cache about a file takes ~5 ms per GiB).
        self._pieces: list[tuple[SharedMapping, int, int]] = []
        self._listed = threading.Event()
        self._claims = itertools.count()  # next() is atomic under the GIL
        self._mapped: list[int] = []
        self._error: FastloadError | None = None
        self._thread: threading.Thread | None = None
        if self.mappings:
            self._thread = threading.Thread(target=self._run, name="fastload-warm-up", daemon=True)
            self._thread.start()

    @property
    def files(self) -> list[_core.SafetensorsFile]:
        """The files read ahead."""
        return [m.file for m in self.mappings.values()]

    @property
    def mapped(self) -> int:
        """Bytes of tensor data mapped in advance so far."""
        return sum(self._mapped)

    def _run(self) -> None:
        try:
            cold = []
            for m in self.mappings.values():
                if m.file.mostly_uncached():
                    cold.append(m)
                    continue
                # piece boundaries on WARM_PIECE multiples, so that no page is mapped twice
                start, stop = m.file.data_start, m.file.file_size
                cuts = [
                    start,
                    *range(start // WARM_PIECE * WARM_PIECE + WARM_PIECE, stop, WARM_PIECE),
                ]
                self._pieces += [(m, a, b) for a, b in zip(cuts, [*cuts[1:], stop], strict=True)]
            self._listed.set()
            for m in cold:
                self.from_disk += m.file.file_size - m.file.data_start
                self._mapped.append(m.map_all())
            self._map_pieces()
        except FastloadError as e:
            self._error = e
        finally:
            self._listed.set()

    def _map_pieces(self) -> None:
        for i in self._claims:
            if i >= len(self._pieces):
                return
            m, start, stop = self._pieces[i]
            self._mapped.append(m.map_span(start, stop))

    def join(self) -> None:
        """Maps the pieces left, beside the helper thread, and waits until every page is read and
        mapped; raises what went wrong (a file truncated under its mapping)."""
        try:
            if self._thread is not None and self._listed.wait() and self._error is None:
                self._map_pieces()
        finally:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
        if self._error is not None:
            raise self._error


def prefetch_in_order(
    mappings: Sequence[SharedMapping],
    budget: MemoryBudget,
    threads: int | None = None,
    *,
    paced: bool = True,
) -> tuple[int, str]:
    """Reads ahead the pages of the views of ``mappings`` (see :meth:`SharedMapping.prefetch`)
    within the read-ahead room of ``budget``, in the order the views were handed out (the model's
    registration order, which its first forward follows); returns the bytes read and how, in
    words for the load report.

    All of them when they fit. When they do not (a model larger than the memory the process may
    use), reading them all now would evict the first before the forward reaches them, and the
    forward would read them again: instead a helper thread reads them paced by the first forward
    (:class:`fastload.core.memory.paced.PacedReadAhead`, at most
    :data:`fastload.core.memory.paced.AHEAD` bytes ahead of it), so every byte is read from storage
    once; without ``paced`` or with ``threads=1`` (no helper threads), or where the page tables
    cannot be read, only the first views that fit are read, now."""
    views = sorted((order, m, offset, n) for m in mappings for order, offset, n in m._viewed)
    room = budget.read_ahead_room()
    total = sum(n for *_, n in views)
    if room is None or total <= room:
        how = "all views (they fit the memory budget)"
    elif paced and PACED and threads != 1 and pacing.supported():
        ahead = min(room, pacing.AHEAD)
        pacing.PacedReadAhead([(m, offset, n) for _, m, offset, n in views], ahead)
        return 0, f"paced by the first forward, at most {format_bytes(ahead)} ahead of it"
    else:
        kept = []
        for view in views:
            if view[3] > room:
                break
            room -= view[3]
            kept.append(view)
        views = kept
        how = f"the first {len(kept)} views in the model's order (what fits the memory budget)"
    done = 0
    for m in mappings:
        spans = _merged([(offset, n) for _, mine, offset, n in views if mine is m])
        if spans:
            done += m._populate(spans, threads, cached=False, cold=False)
    return done, how


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges as sorted, merged ``(start, stop)`` spans."""
    spans: list[tuple[int, int]] = []
    for start, length in sorted(ranges):
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], start + length))
        elif length:
            spans.append((start, start + length))
    return spans


def _pages(size: int, address: int, owner: torch.UntypedStorage) -> Any:
    """The ``size`` bytes at ``address`` as a writable ctypes array (a buffer that
    ``torch.frombuffer`` takes and each storage made from it references), which keeps ``owner``,
    the storage that holds the mapping, alive as long as any tensor made from it."""
    pages = (ctypes.c_char * size).from_address(address)
    pages.owner = owner  # the array does not own its bytes: its owner rides along
    return pages
