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
taken for it. Every fetch counts its bytes in the load's :class:`SliceProgress`.
"""

from __future__ import annotations

import mmap
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from fastload import _core
from fastload.core.progress import bar_wanted, binary_unit
from fastload.core.reading import fill_many

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


class SliceProgress:
    """The progress of a tensor-parallel load from object storage, drawn where
    :func:`~fastload.core.progress.bar_wanted` says so (``enabled``: the loader's ``progress``).

    What a rank fetches is known only as its weight loaders copy (their slices, a norm whole), so
    the bar advances over the checkpoint's ``total`` bytes as the weight loaders take each tensor
    (:meth:`taken`), to 100 % as the local stream's does, and says beside it what this rank
    (``rank``, the process's in ``torch.distributed``, where known) fetched: ``fastload: loading
    weights (rank 0 fetches its slices): 100%|...| 1.09/1.09 GiB [00:04<00:00, 0.55 GiB
    fetched]``. (A bar of the bytes fetched against the checkpoint would stop near 1/N of the way
    on N ranks: a load that reads as cut short.)"""

    #: seconds between two redraws for fetched bytes alone (tqdm's own pace)
    REDRAW = 0.1

    def __init__(self, total: int, enabled: bool, rank: int | None = None) -> None:
        self._unit, self._size = binary_unit(total)
        self._bar: Any = None
        self._drawn = 0.0
        if bar_wanted(total, enabled):
            from tqdm.auto import tqdm

            who = "this rank" if rank is None else f"rank {rank}"
            self._bar = tqdm(
                total=total / self._size,
                unit=self._unit,
                desc=f"fastload: loading weights ({who} fetches its slices)",
                file=sys.stderr,
                bar_format="{l_bar}{bar}| {n:.2f}/{total:.2f} "
                + self._unit
                + " [{elapsed}<{remaining}{postfix}]",
            )
        #: the engine's count of the bytes this rank fetched: every fetch of the load is given it
        self.counter = _core.Progress(None if self._bar is None else self._fetched)

    def _fetched(self, done: int) -> None:
        self._bar.set_postfix_str(f"{done / self._size:.2f} {self._unit} fetched", refresh=False)
        if time.monotonic() - self._drawn >= self.REDRAW:
            self._drawn = time.monotonic()
            self._bar.refresh()  # nothing once closed (tqdm): later fetches are only counted

    def taken(self, nbytes: int) -> None:
        """The weight loaders took a tensor of ``nbytes`` (stored) bytes."""
        if self._bar is not None:
            self._bar.update(nbytes / self._size)

    def close(self) -> None:
        if self._bar is not None:
            done = self.counter.done
            self._bar.set_postfix_str(
                f"{done / self._size:.2f} {self._unit} fetched", refresh=False
            )
            self._bar.close()  # drawn once more, as it ends


def this_rank() -> int | None:
    """This process's rank in ``torch.distributed`` (``None``: no process group)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


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
    whole = [(origin.name, _whole(t, origin), None)]
    fill_many([(origin.remote.file, whole)], threads, None, origin.remote.progress)
    origin.remote.filled = True


def copy_slice(
    dst: torch.Tensor,
    src: torch.Tensor,
    origin: Origin,
    selection: list[int] | None,
    threads: int | None,
) -> None:
    """``dst.copy_(src)`` for ``src``, the ``selection`` of an unread tensor (``None``: all of
    it), fetching only those bytes: straight into ``dst`` where it has ``src``'s dtype and shape,
    else through a temporary of them (torch converts)."""
    assert origin.remote is not None
    file, progress = origin.remote.file, origin.remote.progress
    if dst.shape == src.shape and dst.dtype == src.dtype:
        fill_many([(file, [(origin.name, dst, selection)])], threads, None, progress)
        return
    tmp = torch.empty(src.shape, dtype=src.dtype)
    fill_many([(file, [(origin.name, tmp, selection)])], threads, None, progress)
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
    "SliceProgress",
    "copy_slice",
    "fill_read",
    "fill_whole",
    "is_unread",
    "this_rank",
    "unread_tensor",
]
