"""A reload keeps ties: a tie group the checkpoint stores under several names must hold one value.

A load that finds a tie stored twice with different values unties it
(:func:`fastload.core.finishing.resolve_duplicates`); a reload writes into the memory the model
runs on, where the tie is one tensor, and cannot untie it without giving the model new storage.
So a new checkpoint whose tied names hold different values is refused before a byte is written,
naming the pair (:func:`refuse_differing_ties`), unless the two are the same: equal digests in
the new checkpoint, else the values read compared as the load compares them
(:func:`fastload.core.model.tying.same_values`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import CheckpointError
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.model.tying import same_values
from fastload.core.reads.reading import FillItem
from fastload.reloading.record import Entry, LoadRecord, model_tensor

__all__ = ["memory_key", "refuse_differing_ties"]

#: fills ``{file index: items}`` from the checkpoint (the reload's own file loop)
FillFiles = Callable[[dict[int, list[FillItem]]], None]


def memory_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What makes two model tensors one: a tie, or an alias loaded into the same memory."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _place(model: nn.Module, name: str) -> tuple[int, str]:
    """The storage place itself (the same for a module shared under two names)."""
    owner, _, attr = name.rpartition(".")
    return (id(model.get_submodule(owner) if owner else model), attr)


def refuse_differing_ties(
    model: nn.Module,
    record: LoadRecord,
    ckpt: OpenCheckpoint,
    digests: Mapping[str, str],
    fill: FillFiles,
    label: str,
) -> None:
    """``CheckpointError`` naming every pair of names of one model tensor (a tie) that the
    new checkpoint stores with different values; nothing is written into the model. Runs after
    the reload's check (every tensor the model takes is in ``ckpt``, of a shape that fits)."""
    first: dict[tuple[Any, ...], tuple[Entry, torch.Tensor]] = {}
    pairs: list[tuple[Entry, Entry, torch.Tensor]] = []
    for entry in record.entries:
        dest = model_tensor(model, entry.name)
        if dest is None:
            continue  # refused by the reload's check, naming it
        key = memory_key(dest)
        if key not in first:
            first[key] = (entry, dest)
            continue
        canonical = first[key][0]
        if _place(model, canonical.name) == _place(model, entry.name):
            continue  # one storage place under two names: the load does not compare them
        if not _equal_digests(canonical, entry, ckpt, digests):
            pairs.append((canonical, entry, dest))
    differ: list[str] = []
    for canonical, entry, dest in pairs:
        values = [_read(e, dest, ckpt, fill) for e in (canonical, entry)]
        if not same_values(values[1], values[0]):
            stored = ckpt.tensors[entry.parts[0].stored]
            differ.append(
                f"{ckpt.file_path(stored)}: {_stored(canonical)} and {_stored(entry)} (the "
                f"model's {canonical.name!r} and {entry.name!r}, one tied tensor)"
            )
    if differ:
        raise CheckpointError(
            f"{label} stores tied tensors with different values; a reload writes into the "
            "model's memory, where each tie is one tensor, and cannot untie it (from_pretrained "
            "of this checkpoint loads them untied). Nothing was written. "
            f"{len(differ)} ties:\n  " + "\n  ".join(differ)
        )


def _stored(entry: Entry) -> str:
    return " + ".join(repr(p.stored) for p in entry.parts)


def _equal_digests(a: Entry, b: Entry, ckpt: OpenCheckpoint, digests: Mapping[str, str]) -> bool:
    """Whether the new checkpoint's digests say the two entries are filled with the same bytes."""
    if len(a.parts) != len(b.parts):
        return False
    for p, q in zip(a.parts, b.parts, strict=True):
        dp, dq = digests.get(p.stored), digests.get(q.stored)
        sp, sq = ckpt.tensors.get(p.stored), ckpt.tensors.get(q.stored)
        if dp is None or dp != dq or sp is None or sq is None:
            return False
        if sp.st_dtype != sq.st_dtype or p.selection != q.selection or p.views != q.views:
            return False
    return True


def _read(entry: Entry, dest: torch.Tensor, ckpt: OpenCheckpoint, fill: FillFiles) -> torch.Tensor:
    """What the reload would write into ``dest`` for ``entry``, in host memory of its own."""
    out = torch.empty(tuple(dest.shape), dtype=dest.dtype)
    work: dict[int, list[FillItem]] = {}
    for part in entry.parts:
        target = out
        for view in part.views:
            target = view.apply(target)
        stored = ckpt.tensors[part.stored]
        work.setdefault(stored.file, []).append((part.stored, target, part.selection))
    fill(work)
    return out
