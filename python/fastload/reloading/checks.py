"""A reload's first step: the new checkpoint checked against what the load decided (the record)
and the model's tensors, before a byte is written: every tensor by name, stored shape, dtype and
the shape of the model's tensor (one error naming every tensor that does not fit), and, where both
checkpoints carry digests, the unchanged tensors set aside."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastload.core.basics.dtypes import CONVERTIBLE, to_st
from fastload.core.basics.errors import CheckpointError, ModelMismatchError
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.model.keys import format_names
from fastload.core.plan.placement import selected_shape
from fastload.reloading.record import Entry, LoadRecord, Part, model_tensor
from fastload.reloading.report import ReloadReport
from fastload.reloading.ties import memory_key

__all__ = ["Write", "check_fit", "label", "nbytes", "refuse_unfit", "drop_unchanged"]


@dataclass
class Write:
    """One model tensor to fill: its memory, and each stored part's target within it."""

    entry: Entry
    dest: torch.Tensor
    #: (part, the part of ``dest`` it fills, bytes of the file it takes)
    parts: list[tuple[Part, torch.Tensor, int]]
    file_of: list[int]


def label(ckpt: OpenCheckpoint) -> str:
    location = ckpt.location
    return str(location.index or location.files[0])


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_fit(model: nn.Module, record: LoadRecord, ckpt: OpenCheckpoint) -> list[Write]:
    """Every model tensor to fill, each checked against the new checkpoint: name, stored shape,
    dtype, and the shape of the model's tensor. One error names every tensor that does not fit."""
    shapes: list[str] = []
    other: list[str] = []
    writes: list[Write] = []
    seen: set[tuple[Any, ...]] = set()
    for entry in record.entries:
        dest = model_tensor(model, entry.name)
        if dest is None or dest.device.type == "meta":
            other.append(f"the model has no tensor {entry.name!r} any more (it was loaded)")
            continue
        key = memory_key(dest)
        if key in seen:  # a tie, or an alias loaded into the same memory: filled once
            continue
        seen.add(key)
        write = Write(entry, dest, [], [])
        for part in entry.parts:
            stored = ckpt.tensors.get(part.stored)
            if stored is None:
                other.append(f"tensor {part.stored!r} (the model's {entry.name!r}) is missing")
                continue
            where = f"{ckpt.file_path(stored)}: tensor {part.stored!r}"
            if tuple(stored.shape) != part.shape:
                shapes.append(
                    f"{where} has shape {list(stored.shape)}, the model's {entry.name!r} was "
                    f"loaded from shape {list(part.shape)}"
                )
                continue
            model_st = to_st(dest.dtype)
            if stored.st_dtype != model_st and not (
                stored.st_dtype in CONVERTIBLE and model_st in CONVERTIBLE
            ):
                other.append(
                    f"{where} is stored as {stored.st_dtype} but the model's {entry.name!r} is "
                    f"{model_st}; fastload converts only between F32, F16, BF16 and F64"
                )
                continue
            target = dest
            for view in part.views:
                target = view.apply(target)
            want = selected_shape(stored.torch_shape, part.selection)
            if tuple(target.shape) != want:
                shapes.append(
                    f"{where}: the model's {entry.name!r} now has shape {list(target.shape)} "
                    f"where the load filled {list(want)}"
                )
                continue
            nbytes = stored.nbytes * max(1, target.numel()) // max(1, _numel(stored.torch_shape))
            write.parts.append((part, target, nbytes if target.numel() else 0))
            write.file_of.append(stored.file)
        writes.append(write)
    unknown = sorted(set(ckpt.tensors) - record.names)
    if unknown:
        other.append(
            f"{len(unknown)} tensors the model's checkpoint did not have: {format_names(unknown)}"
        )
    refuse_unfit(
        shapes,
        other,
        f"{label(ckpt)} does not fit the model it would reload ({record.source}); nothing was "
        "written",
    )
    return writes


def refuse_unfit(shapes: list[str], other: list[str], what: str) -> None:
    """Raises, when there are any, the problems of a checkpoint that does not fit (the first 20
    listed after ``what``): ``ModelMismatchError`` when a shape is among them, else
    ``CheckpointError``."""
    problems = shapes + other
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... ({len(problems) - 20} more)" if len(problems) > 20 else ""
        cls = ModelMismatchError if shapes else CheckpointError
        raise cls(f"{what}. {len(problems)} problems:\n  {shown}{more}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def drop_unchanged(
    writes: list[Write],
    old: Mapping[str, str],
    new: Mapping[str, str],
    ckpt: OpenCheckpoint,
    report: ReloadReport,
) -> list[Write]:
    """The writes whose every part has a digest that differs (or is missing on either side)."""
    kept = []
    for write in writes:
        same = all(
            old.get(p.stored) is not None
            and old.get(p.stored) == new.get(p.stored)
            and ckpt.tensors[p.stored].st_dtype == p.st_dtype
            for p, _, _ in write.parts
        )
        if same and write.parts:
            report.tensors_unchanged += 1
            report.bytes_unchanged += sum(n for _, _, n in write.parts)
        else:
            kept.append(write)
    return kept
