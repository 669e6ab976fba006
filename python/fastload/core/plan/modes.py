"""How each loaded tensor of a plan is read (its mode: a view of the file's mapping, a copy, a
conversion, a slice, a merge, left on disk), and the report's counts derived from the plan once."""

from __future__ import annotations

import torch

from fastload import _core
from fastload.core.basics.dtypes import to_st
from fastload.core.basics.engine import TensorFile
from fastload.core.basics.errors import UnsupportedError
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor
from fastload.core.devices.device_map import DISK
from fastload.core.plan.actions import Action, Mode
from fastload.core.plan.load_plan import LoadPlan
from fastload.core.store.object_store import is_remote

__all__ = ["count", "decide_modes"]


def decide_modes(plan: LoadPlan, ckpt: OpenCheckpoint) -> None:
    """How each loaded tensor is read. A whole CPU tensor in its stored dtype, from a file that
    may be mapped (:func:`~fastload.core.memory.sharing.file_sharing`) at an offset aligned for its
    dtype, is a view of the mapping; an untied alias of a stored tensor gets a copy, not a second
    view."""
    viewed: set[str] = set()
    for group in plan.groups:
        if group.action != Action.LOAD:
            continue
        if group.pieces is not None:
            group.sources[0].mode = Mode.MERGE
            dest = group.sources[0].dest
            if dest.device == DISK:
                raise UnsupportedError(
                    f"{group.pieces[0].stored.name!r} is merged into or split from "
                    f"{group.slots[0].name!r}, which the device map offloads to disk; fastload "
                    "reads offloaded tensors by their stored name only: map that module to a "
                    "device"
                )
            continue
        for src in group.sources:
            stored, dest = src.stored, src.dest
            if dest.tensor is not None:
                src.mode = Mode.FILL
            elif dest.device == DISK:  # stays in the file; read when its module runs
                if is_remote(ckpt.files[stored.file]):
                    raise UnsupportedError(
                        f"{ckpt.file_path(stored)}: tensor {stored.name!r} is mapped to 'disk', "
                        "but the checkpoint is in object storage: offloaded tensors are read "
                        "from a local file when their module runs. Map it to a device, or "
                        "download the checkpoint first"
                    )
                src.mode = Mode.OFFLOAD
            elif dest.selection is not None:
                src.mode = Mode.SLICE
            elif to_st(dest.dtype) != stored.st_dtype:
                src.mode = Mode.CONVERT
            elif (
                dest.device.type == "cpu"
                and plan.sharing[stored.file][0]
                and stored.name not in viewed
                and _aligned(ckpt.files[stored.file], stored, dest.dtype)
            ):
                viewed.add(stored.name)
                src.mode = Mode.VIEW
            else:
                src.mode = Mode.COPY


def _aligned(file: TensorFile, stored: StoredTensor, dtype: torch.dtype) -> bool:
    """Whether the bytes of ``stored`` lie at a file offset aligned for ``dtype`` (a view needs
    it; safetensors' writers align, other writers may not)."""
    if not isinstance(file, _core.SafetensorsFile):
        return False
    return (file.data_start + stored.begin) % dtype.itemsize == 0


def count(plan: LoadPlan, ckpt: OpenCheckpoint) -> None:
    """The report's counts of what the plan reads, shares and leaves on disk."""
    report = plan.report
    loaded = plan.sources(Mode.VIEW, Mode.COPY, Mode.CONVERT, Mode.SLICE, Mode.MERGE, Mode.FILL)
    report.tensors_loaded = len(loaded)
    report.bytes_read = sum(s.nbytes for s in loaded if s.mode != Mode.MERGE)
    report.bytes_read += sum(p.nbytes for g in plan.merged for p in g.pieces or ())
    report.bytes_offloaded = sum(s.nbytes for s in plan.sources(Mode.OFFLOAD))
    report.bytes_shared = sum(s.nbytes for s in plan.sources(Mode.VIEW))
    views: dict[int, int] = {}
    copies: dict[int, int] = {}
    for s in loaded:
        if s.mode == Mode.VIEW:
            views[s.stored.file] = views.get(s.stored.file, 0) + 1
        elif s.mode != Mode.MERGE:
            copies[s.stored.file] = copies.get(s.stored.file, 0) + 1
    for g in plan.merged:
        for p in g.pieces or ():
            copies[p.stored.file] = copies.get(p.stored.file, 0) + 1
    report.sharing = {
        f.path: _sharing_line(plan.sharing[i][1], views.get(i, 0), copies.get(i, 0))
        for i, f in enumerate(ckpt.files)
    }


def _sharing_line(why: str, views: int, copies: int) -> str:
    """How one file's tensors were loaded, for the report."""
    if views and copies:
        return f"{views} views, {copies} copies (converted, sharded or misaligned); {why}"
    if views or why.startswith("copies"):
        return why
    return "copies (converted, sharded, misaligned or not on the CPU)"
