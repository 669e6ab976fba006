"""Tensor-parallel ranks that fetch only their slices from object storage (the ``weights``
option under ``--tensor-parallel-size N``).

From local files a rank reads its share because the tensors it is handed are views of a mapping:
the kernel reads the pages a weight loader's copy touches, nothing else. From object storage
there are no pages to fault, so under tensor parallelism
:class:`~fastload.integrations.vllm.remote.RemoteWeights` hands every tensor out **unread**: a
tensor of the stored dtype and shape on an anonymous mapping of its own (no memory until
written), recorded in the load's origins with the file it comes from
(:class:`~fastload.integrations.vllm.weights.Unread`). Then
:class:`~fastload.integrations.vllm.adopt.CopyWatch`, which sees each weight loader's
``param.data.copy_(loaded_weight.narrow(...))``:

* fetches exactly the slice that copy takes, straight into the parameter (:func:`copy_slice`): the
  engine's ranged GETs of the slice's rows (one GET for a slice along the first dimension, one per
  row for a slice along the columns), converted where the parameter's dtype differs; a tensor a
  rank holds whole (norms) is fetched whole;
* fetches the whole tensor first (:func:`fill_read`) before anything else that could read an
  unread tensor's elements runs (arithmetic, a conversion, ``.item()``, printing; only the
  operations in :data:`VIEWS`, which read no element, leave it unread), so no code ever sees bytes
  that were not fetched.

Each unread tensor's record leaves the origins when its memory is freed (a finalizer on its
mapping, which stays mapped until then), so a later allocation at the same address is never
taken for it. Every fetch counts its bytes in the load's bar
(:class:`~.remote_fetches.FetchProgress`).
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fastload.core.reads.reading import fill_many

from .remote_fetches import Fetches
from .weights import Origin

#: the tensor methods and properties that read no element of the tensor (metadata, and views
#: that share its memory); anything else run on an unread tensor fetches it whole first
VIEWS = frozenset(
    {
        "size", "dim", "numel", "stride", "is_contiguous", "data_ptr", "untyped_storage",
        "element_size", "storage_offset", "is_floating_point", "is_complex", "__len__",
        "__hash__", "narrow", "view", "chunk", "split", "t", "transpose", "permute",
        "unsqueeze", "squeeze", "expand", "as_strided", "detach", "unbind",
    }
)  # fmt: skip


def unread_tensor(
    shape: list[int], dtype: torch.dtype, origins: dict[int, Origin], origin: Origin
) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose memory is an anonymous private mapping of its own
    (untouched: no memory used), recorded in ``origins`` as ``origin`` until that memory is
    freed."""
    count = 1
    for n in shape:
        count *= n
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, count * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(memory, dtype=dtype, count=count).view(shape)
    address = tensor.untyped_storage().data_ptr()
    origins[address] = origin
    # runs when the last tensor on the mapping is freed, before it is unmapped
    weakref.finalize(memory, origins.pop, address, None)
    return tensor


def is_unread(origin: Origin | None) -> bool:
    return origin is not None and origin.remote is not None and not origin.remote.filled


def _whole(t: torch.Tensor, origin: Origin) -> torch.Tensor:
    """The whole stored tensor on ``t``'s memory (``t`` may be a slice or a view of it)."""
    whole = torch.empty(0, dtype=t.dtype)
    return whole.set_(t.untyped_storage(), 0, origin.shape)


def fill_whole(t: torch.Tensor, origin: Origin, threads: int | None) -> None:
    """Fetches the whole stored tensor ``t`` is (a view of) into its memory, once."""
    assert origin.remote is not None
    if origin.remote.filled:
        return
    whole = _whole(t, origin)
    fill_many(
        [(origin.remote.file, [(origin.name, whole, None)])], threads, None, _ask(origin, whole)
    )
    origin.remote.filled = True


def _ask(origin: Origin, dst: torch.Tensor) -> Any:
    """Counts a fetch of ``dst``'s bytes in the bar of the load ``origin``'s tensor was handed
    out by, if any; returns the bar's counter for the engine (``None``: no bar)."""
    fetches = origin.remote.fetches if origin.remote is not None else None
    if fetches is None:
        return None
    fetches.ask(dst.numel() * dst.element_size())
    return fetches.counter


def copy_slice(
    dst: torch.Tensor,
    src: torch.Tensor,
    origin: Origin,
    selection: list[int] | None,
    threads: int | None,
) -> None:
    """``dst.copy_(src)`` for ``src``, the ``selection`` of an unread tensor (``None``: all of
    it), fetching only those bytes: straight into ``dst`` where it has ``src``'s dtype and shape
    (queued behind the weight loaders where the tensor's load queues fetches and ``dst`` is
    contiguous CPU memory: :mod:`.remote_fetches`), else through a temporary of them (torch
    converts)."""
    assert origin.remote is not None
    file, fetches = origin.remote.file, origin.remote.fetches
    direct = dst.shape == src.shape and dst.dtype == src.dtype
    cpu = dst.device.type == "cpu" and dst.is_contiguous()
    if direct and cpu and fetches is not None and fetches.defer:
        fetches.submit(file, origin.name, dst, selection)  # made behind the weight loaders
        return
    if fetches is not None:
        fetches.wait_for([dst])  # a queued fetch into these bytes lands first
    if direct:
        fill_many([(file, [(origin.name, dst, selection)])], threads, None, _ask(origin, dst))
        return
    tmp = torch.empty(src.shape, dtype=src.dtype)
    fill_many([(file, [(origin.name, tmp, selection)])], threads, None, _ask(origin, tmp))
    dst.copy_(tmp)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _reads_nothing(func: Any, args: tuple[Any, ...]) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: shape, dtype, device, T, data...
        return True
    if name == "__getitem__" and len(args) >= 2:  # basic indexing is a view; a tensor index reads
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index)
    return name in VIEWS


def wait_pending(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], queues: Iterable[Fetches]
) -> None:
    """Before ``func(*args, **kwargs)`` runs: every queued fetch made where one of its tensors
    has one queued (:mod:`.remote_fetches`), unless ``func`` touches no element."""
    if _reads_nothing(func, args):
        return
    tensors = list(_tensors(args, kwargs))
    for queue in queues:
        queue.wait_for(tensors)


def fill_read(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    origins: dict[int, Origin],
    threads: int | None,
) -> None:
    """Before ``func(*args, **kwargs)`` runs: every unread tensor among its arguments fetched
    whole, unless ``func`` reads no element (:data:`VIEWS`)."""
    if func is not torch.Tensor.copy_ and _reads_nothing(func, args):
        return
    for t in _tensors(args, kwargs):
        if t.device.type != "cpu" or not t.numel():
            continue
        origin = origins.get(t.untyped_storage().data_ptr())
        if is_unread(origin):
            assert origin is not None
            fill_whole(t, origin, threads)


__all__ = [
    "VIEWS",
    "copy_slice",
    "fill_read",
    "fill_whole",
    "is_unread",
    "unread_tensor",
    "wait_pending",
]
