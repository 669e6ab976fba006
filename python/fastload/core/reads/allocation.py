"""Allocating a load's destinations, as its plan says
(:class:`~fastload.core.plan.load_plan.LoadPlan`).

Each new tensor is allocated once, on its final device and dtype: views of the file mapping for
the plan's views (:class:`~fastload.core.memory.sharing.SharedMapping`), empty tensors for the
copies the engine then fills, NaN-filled ones for tensors to initialize; the model family's own
tensors are filled in place. Nothing here decides how a tensor is read: the plan did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch

from fastload import _core
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor
from fastload.core.memory.budget import MemoryBudget, memory_budget
from fastload.core.memory.sharing import SharedMapping, prefetch_in_order
from fastload.core.plan.actions import Action, Mode
from fastload.core.plan.load_plan import Group, LoadPlan
from fastload.core.plan.placement import Selection, selected_shape

__all__ = ["Fill", "allocate", "initial_or_kept"]


class Fill(NamedTuple):
    """One copy for the engine: stored tensor ``name`` (the part ``selection`` takes) into
    ``tensor``."""

    name: str
    tensor: torch.Tensor
    selection: Selection


def allocate(
    load_plan: LoadPlan,
    ckpt: OpenCheckpoint,
    premapped: Mapping[int, SharedMapping],
    *,
    threads: int | None = None,
    budget: MemoryBudget | None = None,
    paced: bool = True,
) -> dict[int, list[Fill]]:
    """Allocates every new tensor once, as the plan says; returns the copies to make per file
    index. Views come from the file mappings, ``premapped`` ones (which the warm-up already
    reads ahead, :class:`~fastload.core.memory.sharing.WarmUp`) or new ones, whose views are read
    ahead here."""
    mappings: dict[int, SharedMapping] = dict(premapped)
    by_file: dict[int, list[Fill]] = {}

    def copy_into(stored: StoredTensor, tensor: torch.Tensor, selection: Selection) -> None:
        by_file.setdefault(stored.file, []).append(Fill(stored.name, tensor, selection))

    for group in load_plan.groups:
        if group.action == Action.LOAD and group.pieces is not None:
            # Merged (MoE experts) or split (fused qkv) tensors: each stored piece is read
            # straight into its slice of the one destination (the family's ``merges`` hook).
            dest = group.sources[0].dest
            tensor = torch.empty(tuple(group.template.shape), dtype=dest.dtype, device=dest.memory)
            for piece in group.pieces:
                copy_into(piece.stored, piece.view(tensor), piece.selection)
            group.dest, group.new = dest, tensor
        elif group.action == Action.LOAD:
            group.dest = group.sources[0].dest
            for i, src in enumerate(group.sources):
                stored, dest = src.stored, src.dest
                if src.mode == Mode.OFFLOAD:  # stays in the file; read when its module runs
                    continue
                if src.mode == Mode.FILL:  # the family's own tensor: filled in place, kept
                    assert dest.tensor is not None
                    copy_into(stored, dest.tensor, dest.selection)
                    continue
                if src.mode == Mode.VIEW:
                    if stored.file not in mappings:
                        file = ckpt.files[stored.file]
                        assert isinstance(file, _core.SafetensorsFile)
                        mappings[stored.file] = SharedMapping(file)
                    view = mappings[stored.file].view(stored.name, dest.dtype)
                    assert view is not None  # the plan checked dtype and alignment
                    tensor = view
                else:
                    shape = selected_shape(stored.torch_shape, dest.selection)
                    tensor = torch.empty(shape, dtype=dest.dtype, device=dest.memory)
                    copy_into(stored, tensor, dest.selection)
                if i == 0:
                    group.new = tensor
                else:
                    group.extra.append((src.slot, tensor))
        else:
            group.new = initial_or_kept(group)
    later = [m for i, m in mappings.items() if i not in premapped]
    if later:  # as far as the budget allows (fastload.core.memory.sharing.prefetch_in_order)
        ahead, how = prefetch_in_order(later, budget or memory_budget(), threads, paced=paced)
        report = load_plan.report
        report.bytes_read_ahead, report.read_ahead = report.bytes_read_ahead + ahead, how
    return by_file


def initial_or_kept(group: Group) -> torch.Tensor | None:
    """The new tensor of a group the checkpoint does not fill: NaN (integers: zeros) for one to
    initialize, the kept tensor moved where its destination says (``None``: it stays as is)."""
    dest = group.dest
    assert dest is not None
    if dest.tensor is not None:  # the family's own tensor, left to the family
        return None
    shape = selected_shape(tuple(group.template.shape), dest.selection)
    if group.action == Action.INIT:
        if dest.dtype.is_floating_point or dest.dtype.is_complex:
            # NaN marks "not initialized yet": skeleton.initialize checks none is left.
            return torch.full(shape, math.nan, dtype=dest.dtype, device=dest.memory)
        return torch.zeros(shape, dtype=dest.dtype, device=dest.memory)
    if group.template.device.type == "meta":
        return None  # caught by the final no-meta check with its name
    t = group.template
    if dest.selection is not None:  # a kept parameter of a module passed in: its shard
        dim, start, stop = dest.selection
        t = t.narrow(dim, start, stop - start)
    if t is not group.template or t.device != dest.memory or t.dtype != dest.dtype:
        return t.detach().to(device=dest.memory, dtype=dest.dtype, copy=True)
    return None
