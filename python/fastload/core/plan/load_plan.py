"""The plan's records (:class:`LoadPlan`): each model tensor's group (a tie group is one tensor
under several names), its action (load, initialize, keep), the sources that fill it with their
destination and mode, and the pieces of a merged tensor. Made once by
:func:`fastload.core.plan.planning.plan`; allocation, reading and finishing consume it and decide
nothing again."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fastload.core.checkpoint.opened import StoredTensor
from fastload.core.model.tying import Slot
from fastload.core.plan.actions import Action, Mode
from fastload.core.plan.hooks import View
from fastload.core.plan.placement import Destination, selected_shape
from fastload.core.plan.report import LoadReport

__all__ = ["Group", "LoadPlan", "Source", "StoredPiece", "source_bytes"]


@dataclass
class Source:
    """A model tensor (``slot``) that checkpoint tensor ``stored`` fills: where it goes
    (``dest``) and how (``mode``)."""

    slot: Slot
    stored: StoredTensor
    dest: Destination
    mode: Mode = Mode.COPY

    @property
    def nbytes(self) -> int:
        """The bytes of the file it takes."""
        return source_bytes(self.stored, self.dest)


@dataclass
class Group:
    """All slots holding one tensor (a tie group has several) and what happens to it."""

    slots: list[Slot]
    template: torch.Tensor
    # loaded members, canonical first
    sources: list[Source] = field(default_factory=list)
    action: Action = Action.KEEP
    dest: Destination | None = None
    new: torch.Tensor | None = None
    # further members also present in the checkpoint, loaded to compare with the canonical one
    extra: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    untied: list[Slot] = field(default_factory=list)
    # a tensor assembled from stored pieces (merged MoE experts, a split fused qkv)
    pieces: list[StoredPiece] | None = None

    @property
    def is_buffer(self) -> bool:
        return self.slots[0].is_buffer

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def keyed(self) -> list[str]:
        """Names that belong in a state dict (parameters and persistent buffers)."""
        return [s.name for s in self.slots if not s.is_buffer or s.persistent]


@dataclass(frozen=True)
class StoredPiece:
    """A :class:`Piece` resolved against the checkpoint: what the copy engine reads, and where."""

    stored: StoredTensor
    views: tuple[View, ...]
    selection: list[int] | None
    nbytes: int

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the model tensor ``tensor`` this piece fills (a view of it)."""
        for step in self.views:
            tensor = step.apply(tensor)
        return tensor


@dataclass
class LoadPlan:
    """What one load does, decided once: every tensor group with its sources, destinations and
    modes (:class:`Group`, :class:`Source`), and the report of what matched."""

    groups: list[Group]
    report: LoadReport
    #: file index -> (whether its tensors may be views of its mapping, why in words)
    sharing: dict[int, tuple[bool, str]]
    #: model names the family's operations make after the read (ModelHooks.operations)
    operations: set[str] = field(default_factory=set)

    def sources(self, *modes: Mode) -> list[Source]:
        """The sources of the loaded groups in any of ``modes`` (all of them without)."""
        return [
            src
            for g in self.groups
            if g.action == Action.LOAD
            for src in g.sources
            if not modes or src.mode in modes
        ]

    @property
    def merged(self) -> list[Group]:
        """The groups assembled from stored pieces."""
        return [g for g in self.groups if g.action == Action.LOAD and g.pieces is not None]


def source_bytes(stored: StoredTensor, dest: Destination) -> int:
    """The bytes of ``stored`` that fill ``dest``."""
    if dest.selection is None:
        return stored.nbytes
    shape = stored.torch_shape
    total = math.prod(shape) or 1
    if dest.tensor is not None:  # the family's own tensor holds exactly its part
        return stored.nbytes * dest.tensor.numel() // total
    return stored.nbytes * math.prod(selected_shape(shape, dest.selection)) // total
