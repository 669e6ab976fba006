"""``reload(atomic=True, verify=True)``: each stored tensor's bytes checked against the digest its
file records, as they were read, before any conversion or slicing.

A digest covers a stored tensor's bytes, whole and in its stored dtype. A staged copy that takes
them as they are (whole, same dtype, contiguous on the CPU) is filled by the copy engine and hashed
where it is. Any other (converted to the model's dtype, a tensor-parallel slice, on an
accelerator) is read whole, in its stored dtype, into host memory of its own, hashed there, and
its staged copy made from those same bytes by torch (the selection, the conversion, the copy to
the device; the engine converts exactly as torch's ``Tensor.to``). What is committed is what was
checked, whatever the destination. A slice is checked by reading its whole stored tensor: under
N-way tensor parallelism a rank reads N times its share of such a tensor. The whole tensors are
read in batches of at most :data:`SCRATCH_BYTES` (or the largest one), so the memory beside the
staged copies stays bounded (:func:`add_scratch`, counted by the memory check).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from fastload.core.basics.dtypes import TORCH_TO_ST, to_torch, torch_shape
from fastload.core.basics.errors import CheckpointError
from fastload.core.checkpoint.digests import bytes_digest
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.model.keys import format_names
from fastload.core.reads.reading import FillItem

__all__ = ["SCRATCH_BYTES", "add_scratch", "read_verified"]

#: host memory for the whole stored tensors read at once to be checked (at least the largest)
SCRATCH_BYTES = 256 << 20

#: fills ``{file index: items}`` from the checkpoint (the reload's own file loop)
FillFiles = Callable[[dict[int, list[FillItem]]], None]


def _exact(ckpt: OpenCheckpoint, item: FillItem) -> bool:
    """Whether the staged copy holds the stored bytes as they are, hashable where it is."""
    name, target, selection = item
    return (
        selection is None
        and TORCH_TO_ST.get(target.dtype) == ckpt.tensors[name].st_dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
    )


def add_scratch(
    need: dict[torch.device, int],
    items: Sequence[FillItem],
    ckpt: OpenCheckpoint,
    digests: Mapping[str, str],
) -> None:
    """Adds to ``need`` (bytes per device) the host memory :func:`read_verified` takes beside
    the staged copies ``items``: the whole stored tensors it reads to hash (none: no digests)."""
    sizes = [
        ckpt.tensors[item[0]].nbytes
        for item in items
        if item[0] in digests and not _exact(ckpt, item)
    ]
    if sizes:
        cpu = torch.device("cpu")
        need[cpu] = need.get(cpu, 0) + min(sum(sizes), max(SCRATCH_BYTES, max(sizes)))


def read_verified(
    by_file: Mapping[int, list[FillItem]],
    ckpt: OpenCheckpoint,
    digests: Mapping[str, str],
    fill: FillFiles,
    named: Callable[[str], str] | None = None,
) -> tuple[dict[int, list[FillItem]], int]:
    """Fills and checks every staged copy (stored name, target, selection) whose stored tensor
    has a digest in ``digests``. Returns the items left to fill (their tensor has no digest) and
    how many were checked; ``CheckpointError`` naming every tensor whose bytes differ from its
    digest (``named``: how, right after the ``fill`` that read it; by default its file and
    name)."""
    rest: dict[int, list[FillItem]] = {}
    direct: dict[int, list[FillItem]] = {}
    scratch: list[tuple[int, FillItem]] = []
    for index, items in by_file.items():
        for item in items:
            if item[0] not in digests:
                rest.setdefault(index, []).append(item)
            elif _exact(ckpt, item):
                direct.setdefault(index, []).append(item)
            else:
                scratch.append((index, item))
    wrong: list[str] = []
    if direct:
        fill(direct)
        hashed = [(name, target) for items in direct.values() for name, target, _ in items]
        wrong += _differ(hashed, ckpt, digests, named)
    for batch in _batches(scratch, ckpt):
        whole: dict[str, torch.Tensor] = {}
        work: dict[int, list[FillItem]] = {}
        for index, (name, _, _) in batch:
            if name not in whole:  # several copies of one stored tensor: read once
                stored = ckpt.tensors[name]
                where = f"{ckpt.file_path(stored)}: tensor {name!r}"
                dtype = to_torch(stored.st_dtype, where=where)
                shape = torch_shape(stored.st_dtype, list(stored.shape), where=where)
                whole[name] = torch.empty(shape, dtype=dtype)
                work.setdefault(index, []).append((name, whole[name], None))
        fill(work)
        wrong += _differ(list(whole.items()), ckpt, digests, named)
        with torch.no_grad():
            for _, (name, target, selection) in batch:
                target.copy_(_take(whole[name], selection).reshape(target.shape))
    if wrong:
        raise CheckpointError(
            f"{len(wrong)} tensors read do not match the digest their file records (the file "
            f"changed after it was written, or is corrupt): {format_names(wrong)}"
        )
    return rest, sum(len(items) for items in direct.values()) + len(scratch)


def _batches(
    scratch: list[tuple[int, FillItem]], ckpt: OpenCheckpoint
) -> Iterator[list[tuple[int, FillItem]]]:
    """``scratch`` in runs whose distinct stored tensors total at most :data:`SCRATCH_BYTES`
    (a larger tensor alone)."""
    batch: list[tuple[int, FillItem]] = []
    names: set[str] = set()
    held = 0
    for index, item in scratch:
        size = 0 if item[0] in names else ckpt.tensors[item[0]].nbytes
        if batch and held + size > SCRATCH_BYTES:
            yield batch
            batch, names, held = [], set(), 0
            size = ckpt.tensors[item[0]].nbytes
        batch.append((index, item))
        names.add(item[0])
        held += size
    if batch:
        yield batch


def _take(whole: torch.Tensor, selection: object) -> torch.Tensor:
    """The part of a whole stored tensor a selection takes, as the copy engine takes it: a
    richer selection's own ``take``, a flat ``[start, stop]`` range, or ``[dim, start, stop]``."""
    take = getattr(selection, "take", None)
    if callable(take):
        return take(whole)
    if selection is None:
        return whole
    assert isinstance(selection, (list, tuple))
    if len(selection) == 2:
        return whole.reshape(-1)[selection[0] : selection[1]]
    dim, start, stop = selection
    return whole.narrow(dim, start, stop - start)


def _differ(
    hashed: Sequence[tuple[str, torch.Tensor]],
    ckpt: OpenCheckpoint,
    digests: Mapping[str, str],
    named: Callable[[str], str] | None = None,
) -> list[str]:
    """Where each tensor is stored (``named``), for those whose bytes do not hash to their
    digest."""
    # hashlib hashes without the GIL: one thread per core
    workers = max(1, min(os.cpu_count() or 1, 16, len(hashed) or 1))
    with ThreadPoolExecutor(workers) as pool:
        equal = list(pool.map(lambda h: bytes_digest(h[1]) == digests[h[0]], hashed))
    if named is None:
        named = lambda name: f"{ckpt.file_path(ckpt.tensors[name])}: tensor {name!r}"  # noqa: E731
    return [named(name) for (name, _), ok in zip(hashed, equal, strict=True) if not ok]
