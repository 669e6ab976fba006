"""Whether a planned load fits the memory budget: the memory of its own a plan will hold (what is
not a view of the file mapping), counted before anything is allocated."""

from __future__ import annotations

import math
from typing import Any

from fastload.core.memory.budget import MemoryBudget, check_owned
from fastload.core.plan.actions import Action, Mode

__all__ = ["check_owned_memory"]


def check_owned_memory(load_plan: Any, mmap: str, pool: Any, budget: MemoryBudget) -> None:
    """Refuses (:func:`check_owned`) a planned load whose memory of its own does not fit
    ``budget``: CPU tensors that are not views of the file mapping (``mmap="copy"``, a dtype
    conversion, a slice, a tensor merged from pieces, a file that cannot be mapped, a shard of
    the model family's), plus the pinned staging pool ``pool`` when tensors go to an
    accelerator. Run after planning, before anything is allocated (``load_plan``:
    :class:`fastload.core.plan.load_plan.LoadPlan`, whose modes say which tensors are views)."""
    if budget.available is None:
        return
    owned, reasons, accelerator = 0, set(), False
    for group in load_plan.groups:
        if group.action != Action.LOAD:
            continue
        if group.pieces is not None:
            dest = group.sources[0].dest
            if dest.device.type == "cpu":
                owned += math.prod(group.template.shape) * dest.dtype.itemsize
                reasons.add("tensors merged from pieces")
            accelerator |= dest.device.type not in ("cpu", "disk")
            continue
        for src in group.sources:
            dest, stored = src.dest, src.stored
            if src.mode in (Mode.VIEW, Mode.OFFLOAD):  # page cache (reclaimable), or left on disk
                continue
            if dest.device.type != "cpu":
                accelerator = True
                continue
            if dest.tensor is not None:
                owned += dest.tensor.numel() * dest.dtype.itemsize
                reasons.add("tensor-parallel shards")
                continue
            # the elements of its part of the stored tensor, in the destination's dtype
            elements = math.prod(stored.torch_shape) * src.nbytes // max(stored.nbytes, 1)
            owned += elements * dest.dtype.itemsize
            if src.mode == Mode.CONVERT:
                reasons.add(f"conversion to {str(dest.dtype).removeprefix('torch.')}")
            elif src.mode == Mode.SLICE:
                reasons.add("slices")
            elif mmap == "copy":
                reasons.add("mmap='copy'")
            else:
                reasons.add(load_plan.sharing[stored.file][1])
    if accelerator:
        owned += pool.slot_bytes * pool.num_slots
        reasons.add("pinned staging slots")
    if owned:
        check_owned(owned, budget, ", ".join(sorted(reasons)))
