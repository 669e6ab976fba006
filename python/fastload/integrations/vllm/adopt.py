"""What happens where a vLLM weight loader copies a checkpoint tensor into a parameter.

vLLM's weight loaders end in ``param.data.copy_(loaded_weight)`` (after narrowing the checkpoint
tensor to this rank's shard, or into a slice of a fused parameter). :class:`CopyWatch`, a torch
function mode active while ``model.load_weights`` runs, sees each such copy whose source is a
tensor fastload handed out, and:

* **adopts** the source where the copy is a whole parameter kept exactly as stored (same shape,
  dtype, contiguous, on the CPU, the parameter owning its whole storage): the parameter becomes the
  view of the checkpoint's mapping (``param.data = view``) instead of a copy of it. The view is a
  page of the page cache until written (copy-on-write), so replicas on one host share one copy;
  its pages leave the server's page tables as soon as nothing uses them (a parameter vLLM's
  post-load processing replaced);
* **copies with the engine** (one rank) where the copy is a whole checkpoint tensor into a
  contiguous CPU destination of the same shape (a parameter, or the rows of a fused
  qkv/gate_up parameter), of its dtype or converted between F32, F16, BF16 and F64 (an engine
  of another dtype than the checkpoint's): the Rust engine reads the bytes from the file (the
  page cache the read-ahead filled) on several threads with the GIL released, straight into the
  destination, whose pages it faults in batches; no page of the mapping is touched. In a load
  (``defer``) the copy is queued and made behind the weight loaders, in batches
  (:class:`.remote_fetches.Fetches`: nothing touches the destination before its bytes are in,
  writes to the same bytes land in the order made, the weights stream's end and the mode's exit
  wait for them all);
* under tensor parallelism **reads the slice** a weight loader takes just before torch copies it:
  exactly its pages (``POSIX_FADV_WILLNEED`` per row span, issued together so the disk serves
  them in parallel), the mapping being ``MADV_RANDOM`` so no fault reads the other ranks' bytes.
  Not through the engine's positioned reads: a read that meets the page-cache read-ahead mark the
  header's read left starts the kernel's asynchronous read-ahead, which ``POSIX_FADV_RANDOM``
  does not stop (measured: 24 MiB read for an 8 MiB half of a 16 MiB tensor), and reads the other
  ranks' bytes;
* from object storage (the ``weights`` option: into CPU parameters, or under tensor
  parallelism), **queues the fetch of the slice** a weight loader takes from the unread tensor it
  was handed, made straight into the parameter behind the weight loaders (:mod:`.remote_fetches`:
  nothing touches the parameter before its bytes are in, and the mode's exit waits for them all),
  and fetches an unread tensor whole before anything else reads it (:mod:`.remote_slices`);
* **checks** that a copy takes as many elements as it gives (``copy_`` would otherwise broadcast
  a checkpoint tensor of the wrong shape silently), raising fastload's error naming the file and
  the tensor.

Copies from anything else (a converted tensor, a parameter to a parameter) run untouched.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fastload.core.basics.dtypes import CONVERTIBLE, PACKED, TORCH_TO_ST, to_st
from fastload.core.basics.engine import copy_into
from fastload.core.basics.errors import ModelMismatchError
from fastload.core.memory.budget import memory_budget
from fastload.safetensors.preparing import byte_span

from . import remote_slices
from .remote_fetches import Fetches
from .weights import Origin

_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = 4
#: row spans merged into one read only where they touch (a gap is another rank's bytes)
_MERGE_GAP = 1
#: bytes below which a copy stays torch's (the engine's call costs more than it saves)
ENGINE_MIN = 256 << 10


def _dropped_when_freed(view: torch.Tensor) -> torch.Tensor:
    """A tensor on the bytes of ``view`` (a view of a file mapping, owning its storage) whose
    whole pages are dropped from this process's page tables (``MADV_DONTNEED``; they stay in the
    page cache) as soon as no tensor uses them any more: vLLM's post-load processing replaces
    most parameters (on CPU it repacks every linear weight for oneDNN), and the pages of the one
    it replaced would otherwise stay mapped, counted in the server's RSS, until the whole mapping
    goes, raising its peak above that of a load that copies (whose copies are freed one by
    one)."""
    nbytes = view.numel() * view.element_size()
    address = view.data_ptr()
    buffer = (ctypes.c_char * nbytes).from_address(address)
    buffer.owner = view  # the view, hence the mapping, lives as long as the buffer
    out = torch.frombuffer(buffer, dtype=view.dtype, count=view.numel()).view(view.shape)
    # runs when the last storage on the buffer is freed, while the mapping is still mapped
    weakref.finalize(buffer, _drop_pages, address, nbytes)
    return out


def _drop_pages(address: int, nbytes: int) -> None:
    """``MADV_DONTNEED`` on the whole pages inside ``[address, address + nbytes)`` (pages shared
    with a neighbouring tensor are left alone); advisory, a failure changes memory, not data."""
    start = -(-address // _PAGE) * _PAGE
    stop = (address + nbytes) // _PAGE * _PAGE
    if stop > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_DONTNEED)


def _owns_storage(t: torch.Tensor) -> bool:
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


class CopyWatch(TorchFunctionMode):
    """The torch function mode described in the module docstring, for one ``load_weights``."""

    def __init__(
        self,
        origins: dict[int, Origin],
        params: Iterable[tuple[str, torch.Tensor]],
        *,
        tp_size: int,
        adopt: bool,
        threads: int | None = None,
        engine_min: int = ENGINE_MIN,
        remote: bool = False,
        defer: bool = False,
    ) -> None:
        super().__init__()
        #: the engine's copies queued behind the weight loaders (one rank, local files), or None:
        #: each made as it is asked (a reload's recovery takes a copy that returned as written)
        self.deferred = (
            Fetches(threads, ahead=memory_budget().read_ahead_room())
            if defer and tp_size == 1
            else None
        )
        #: bytes below which a copy stays torch's (a reload passes 0: no page of a mapping
        #: touched, so a file truncated meanwhile is a read error, never a SIGBUS)
        self.engine_min = engine_min
        #: whether unread tensors from object storage may be handed out (:mod:`.remote_slices`)
        self.remote = remote
        #: the engine's threads for the copies it makes (``None``: its default)
        self.threads = threads
        #: storage address -> origin of the tensors handed out (filled as they are)
        self.origins = origins
        self.tp_size = tp_size
        self.adopt = adopt
        #: parameters (and how many tensors of the model use each storage) by data address
        self._params: dict[int, torch.nn.Parameter] = {}
        users: dict[int, int] = {}
        for _name, p in params:
            if p.numel() == 0 or p.device.type != "cpu":
                continue
            ptr = p.untyped_storage().data_ptr()
            users[ptr] = users.get(ptr, 0) + 1
            if isinstance(p, torch.nn.Parameter) and _owns_storage(p):
                self._params[ptr] = p
        # a storage another tensor of the model also uses cannot be swapped for a view
        for ptr, n in users.items():
            if n > 1:
                self._params.pop(ptr, None)
        self.adopted = 0
        self.adopted_bytes = 0
        self.copied_bytes = 0
        #: bytes of those copies the engine made
        self.engine_bytes = 0
        self.slices_read = 0
        #: the queues of fetches made behind the weight loaders this load used (by id)
        self._fetches: dict[int, Fetches] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        copy = func is torch.Tensor.copy_
        if self._fetches and not (copy and self._handed_out(args)):
            # nothing touches a parameter before the copies queued into it are made (a copy
            # from a tensor handed out orders itself: queued behind them, or waits in _copy)
            remote_slices.wait_pending(func, args, kwargs, self._fetches.values())
        if self.remote:
            # an unread tensor is fetched before anything reads it, or writes into it (a copy_
            # from one is the weight loaders' copy, below)
            reads = (args[:1], {}) if copy else (args, kwargs)
            remote_slices.fill_read(func, *reads, self.origins, self.threads)
        if func is torch.Tensor.copy_ and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.numel():
                origin = self.origins.get(src.untyped_storage().data_ptr())
                if origin is not None:
                    handled = self._copy(dst, src, origin)
                    if handled:
                        return dst
                    if self._fetches:  # torch copies: a queued copy into dst lands first
                        remote_slices.wait_pending(func, (dst,), {}, self._fetches.values())
        return func(*args, **kwargs)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        fetches, self._fetches = list(self._fetches.values()), {}
        for queue in fetches:
            if exc_type is None:
                queue.drain()  # raises a fetch's failure
            else:
                queue.stop()  # the load failed: what is queued is not made

    def _handed_out(self, args: tuple[Any, ...]) -> bool:
        src = args[1] if len(args) >= 2 else None
        return isinstance(src, torch.Tensor) and src.untyped_storage().data_ptr() in self.origins

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, origin: Origin) -> bool:
        if dst.numel() != src.numel() and src.numel() != 1:
            raise ModelMismatchError(
                f"{origin.path}: tensor {origin.name!r}: the model's weight loader copies it "
                f"(shape {list(src.shape)}, {src.dtype}) into a parameter of shape "
                f"{list(dst.shape)} ({dst.dtype}); the checkpoint does not fit the model "
                "[shape-mismatch]"
            )
        if origin.remote is not None:
            return self._remote_copy(dst, src, origin)
        param = self._params.get(dst.untyped_storage().data_ptr()) if self.adopt else None
        if (
            param is not None
            and origin.mapping is not None
            and dst.data_ptr() == param.data_ptr()
            and dst.shape == param.shape == src.shape
            and dst.dtype == param.dtype == src.dtype
            and _owns_storage(src)
            and src.device.type == "cpu"
        ):
            self._read(src, origin)
            param.data = _dropped_when_freed(src)
            del self._params[dst.untyped_storage().data_ptr()]
            self.adopted += 1
            self.adopted_bytes += src.numel() * src.element_size()
            return True
        nbytes = src.numel() * src.element_size()
        self.copied_bytes += nbytes
        if origin.mapping is not None and self.tp_size == 1 and self._engine_copy(dst, src, origin):
            self.engine_bytes += nbytes
            return True
        if origin.mapping is not None and self.tp_size > 1:
            self._read(src, origin)
        return False

    def _remote_copy(self, dst: torch.Tensor, src: torch.Tensor, origin: Origin) -> bool:
        """``dst.copy_(src)`` where ``src`` is (a view of) an unread tensor from object storage:
        only the slice it takes is fetched (:mod:`.remote_slices`). Into a meta tensor nothing
        is fetched: vLLM's layerwise reload runs each weight loader on the layer's meta
        parameters first, to count what it copies, and again once the layer is materialized."""
        if not remote_slices.is_unread(origin) or dst.is_meta:
            return False  # fetched whole already (torch copies), or a copy that reads nothing
        selection = _selection(src, origin.shape, src.untyped_storage().data_ptr())
        if selection is False:  # not a slice the engine reads: the whole tensor, then torch
            remote_slices.fill_whole(src, origin, self.threads)
            return False
        remote_slices.copy_slice(dst, src, origin, selection, self.threads)
        fetches = origin.remote.fetches if origin.remote is not None else None
        if fetches is not None:
            self._fetches[id(fetches)] = fetches
        self.copied_bytes += src.numel() * src.element_size()
        if selection is not None:
            self.slices_read += 1
        return True

    def _engine_copy(self, dst: torch.Tensor, src: torch.Tensor, origin: Origin) -> bool:
        """Copies ``src`` (a view of ``origin``, whole or sliced along one dimension) into ``dst``
        with the engine, converting between the floating-point dtypes it converts (an engine of
        another dtype than the checkpoint's: torch's converting copy would read the mapping,
        where a file truncated meanwhile is a SIGBUS); ``False`` (nothing done) where that is
        not such a copy."""
        if (
            src.numel() * src.element_size() < self.engine_min
            or dst.device.type != "cpu"
            or not _engine_converts(src.dtype, dst.dtype)
            or dst.shape != src.shape
            or not dst.is_contiguous()
            or origin.mapping is None
        ):
            return False
        selection = _selection(src, origin.shape, src.untyped_storage().data_ptr())
        if selection is False or (selection is not None and origin.st_dtype in PACKED):
            return False  # the engine cuts no packed sub-byte tensor: torch copies the view
        if self.deferred is not None:  # made behind the weight loaders, in batches
            self.deferred.submit(origin.mapping.file, origin.name, dst, selection)
            self._fetches[id(self.deferred)] = self.deferred
            return True
        copy_into(
            origin.mapping.file, [(origin.name, dst, to_st(dst.dtype), selection)], self.threads
        )
        return True

    def _read(self, src: torch.Tensor, origin: Origin) -> None:
        """Asks the kernel for the pages of ``src`` (a view of ``origin``'s mapping) under tensor
        parallelism, where nothing was read ahead: every span at once, so the copy's faults wait
        on reads already in flight instead of issuing them one page at a time."""
        mapping = origin.mapping
        if mapping is None or self.tp_size <= 1:
            return
        fd = mapping.file.fileno()
        if fd is None:
            return
        for start, stop in _spans(src, mapping.address):
            os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)
        self.slices_read += 1


def _engine_converts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether the engine's copy gives ``dst`` from ``src``: the same dtype, or a conversion
    between F32, F16, BF16 and F64 (made during the copy, as torch's ``copy_`` rounds)."""
    if src == dst:
        return True
    return TORCH_TO_ST.get(src) in CONVERTIBLE and TORCH_TO_ST.get(dst) in CONVERTIBLE


def _selection(src: torch.Tensor, shape: tuple[int, ...], base: int) -> list[int] | None | bool:
    """The engine's selection for ``src``, a view of a stored tensor of ``shape`` whose first
    element is at ``base``: ``None`` for the whole tensor, ``[dim, start, stop]`` for a slice along
    one dimension, ``False`` for anything else (a transpose, a view of several dimensions)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    if src.dim() != len(shape) or list(src.stride()) != strides:
        return False
    offset, rest = divmod(src.data_ptr() - base, src.element_size())
    if rest:
        return False
    differ = [d for d in range(len(shape)) if src.shape[d] != shape[d]]
    if not differ:
        return None if offset == 0 else False
    if len(differ) > 1:
        return False
    d = differ[0]
    start, rest = divmod(offset, strides[d])
    if rest or start + src.shape[d] > shape[d]:
        return False
    return [d, start, start + src.shape[d]]


def _spans(t: torch.Tensor, base: int) -> list[tuple[int, int]]:
    """File byte spans ``[start, stop)`` (whole pages) that the elements of ``t`` occupy, for a
    tensor viewing a mapping at ``base``: one span for a contiguous tensor, one per row for a 2-D
    one sliced along its columns (neighbours merged when close), the enclosing span otherwise."""
    item = t.element_size()
    first = t.data_ptr() - base
    if t.is_contiguous() or t.dim() == 0:
        spans = [(first, first + t.numel() * item)]
    elif t.dim() == 2 and t.stride(1) == 1:
        row = t.size(1) * item
        spans = [
            (first + r * t.stride(0) * item, first + r * t.stride(0) * item + row)
            for r in range(t.size(0))
        ]
    else:
        start, end = byte_span(t)
        spans = [(start - base, end - base)]
    merged: list[tuple[int, int]] = []
    for a, b in spans:
        a, b = a // _PAGE * _PAGE, -(-b // _PAGE) * _PAGE
        if merged and a - merged[-1][1] < _MERGE_GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


__all__ = ["CopyWatch"]
