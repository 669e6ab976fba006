"""What a model family adds to the core pipeline, as a small interface, and its vocabulary.

The core loader knows torch modules only. A family of models with conventions of its own (registered
renames, buffers that used to be persistent, finishing steps) supplies a :class:`ModelHooks`. The
entry of a load chooses it (:class:`fastload.core.plan.target.Target`'s ``hooks``, or its
``choose_hooks`` for a model built from a factory): the core never asks which family a model belongs
to. A family that assembles model tensors from pieces of stored ones describes them as
:class:`Merge` records of :class:`Piece` steps."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from fastload.core.checkpoint.opened import OpenCheckpoint
    from fastload.core.devices.device_map import DeviceMap
    from fastload.core.model.keys import KeyRules, Rename
    from fastload.core.model.tying import Slot
    from fastload.core.plan.report import LoadReport


@dataclass(frozen=True)
class Select:
    """A step from a tensor to the part a piece fills: ``tensor.select(dim, index)``."""

    dim: int
    index: int

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.select(self.dim, self.index)


@dataclass(frozen=True)
class Narrow:
    """A step from a tensor to the part a piece fills: ``tensor.narrow(dim, start, length)``."""

    dim: int
    start: int
    length: int

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length)


View = Select | Narrow


@dataclass
class FamilyShards:
    """Destinations a model family made itself (its own tensor-parallel parameters): by model
    name, an object with the local ``tensor`` to fill in place and the ``selection`` of the
    stored tensor it holds (``None``: all of it; else ``[dim, start, stop]`` or an object whose
    ``take(full)`` gives the part). ``later``: names the family fills itself after the load
    (tied copies), neither missing nor initialized by fastload."""

    tensors: dict[str, Any]
    later: set[str] = field(default_factory=set)


@dataclass
class Piece:
    """One stored tensor (or the part ``selection``, ``(dim, start, stop)``, takes of it) and
    the part of a model tensor it fills (``views``, applied in order)."""

    stored: str
    views: tuple[View, ...]
    selection: tuple[int, int, int] | None = None


@dataclass
class Merge:
    """A model tensor assembled from pieces of stored tensors (a model family's conversions:
    merged MoE experts, split fused ``qkv``; see :meth:`ModelHooks.merges`)."""

    target: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Operation:
    """A model tensor its family computes after the read from whole stored tensors (a
    quantizer's load operation, :meth:`ModelHooks.operations`): the stored ``inputs`` are not
    matched by name, and ``target`` is neither read nor reported missing nor initialized."""

    target: str
    inputs: list[str] = field(default_factory=list)


class ModelHooks:
    """The core's questions to a model family; the defaults are those of a plain ``nn.Module``."""

    def renames(self, model: nn.Module, source: str) -> Sequence[Rename] | Callable[[], Any]:
        """Renamings applied to checkpoint names before matching (may be a builder, called only
        when some name does not match directly)."""
        return ()

    def merges(
        self,
        model: nn.Module,
        ckpt: OpenCheckpoint,
        model_keys: set[str],
        rules: KeyRules,
    ) -> dict[str, Merge]:
        """Model tensors assembled from pieces of stored tensors, by model name (``rules``: how
        names map, :class:`fastload.core.model.keys.KeyRules`). The stored tensors they use are not
        mapped by name."""
        return {}

    def operations(
        self,
        model: nn.Module,
        ckpt: OpenCheckpoint,
        model_keys: set[str],
        rules: KeyRules,
    ) -> dict[str, Operation]:
        """Model tensors the family computes from stored tensors after the read, by model name
        (it fills them in its :meth:`finish`); checked from the headers here, before anything
        is read."""
        return {}

    def collision_order(self) -> Callable[[str], Any] | None:
        """``None``: two checkpoint tensors that map onto one model tensor are refused
        (``CheckpointError``); a sort key of checkpoint names: the first in that order loads."""
        return None

    def resolve_names(self, model: nn.Module) -> Callable[[str, str, set[str]], str] | None:
        """The family's own last step of mapping a checkpoint name, in place of the core's
        base-model prefix change and legacy rename (:class:`fastload.core.model.keys.KeyRules`):
        (name after the renames, stored name, model names) -> model-side name."""
        return None

    def tie_source_order(self, model: nn.Module) -> Callable[[str], Any] | None:
        """Which stored member of a tie group the group takes its values from when the
        checkpoint holds several (the others are compared with it, and untied if they differ):
        a sort key of model names, the least first; ``None``: the first in the model's order."""
        return None

    def refuse_no_match(self) -> bool:
        """Whether a checkpoint none of whose tensors matches the model is refused
        (``CheckpointError``: a checkpoint of another model, or the wrong file); ``False``
        loads it, every model tensor missing."""
        return True

    def auto_dtype(self, ckpt: OpenCheckpoint) -> torch.dtype | None:
        """What ``dtype="auto"`` means for a model built for this load (``None``: each
        tensor's stored dtype)."""
        return None

    def authorized_unexpected(self, model: nn.Module, slots: list[Slot]) -> list[str]:
        """Regex patterns of checkpoint names that are expected to have no place in the model."""
        return []

    def keep_fp32(self, model: nn.Module, dtype: torch.dtype | None) -> re.Pattern[str] | None:
        """Names that stay float32 under an explicit floating ``dtype``."""
        return None

    def prepare(self, model: nn.Module) -> None:
        """Runs right after fastload built ``model``'s skeleton, before anything is planned."""

    def shard(self, model: nn.Module) -> FamilyShards | None:
        """The family's own destinations for a skeleton it built (``None``: fastload allocates
        every tensor)."""
        return None

    def initialize(self, model: nn.Module, targets: dict[str, torch.Tensor]) -> set[str]:
        """Initializes, the family's way, those of ``targets`` (model name -> NaN-filled tensor
        in the model) it knows how to; returns their names. The rest are reset by their
        modules' ``reset_parameters()`` (:func:`fastload.core.model.skeleton.initialize`)."""
        return set()

    def dropped_attributes(self) -> frozenset[str]:
        """Attributes of the skeleton's parameters that the loaded parameters do not take over
        (a family's own flags of what it initialized itself)."""
        return frozenset()

    def finish(
        self,
        model: nn.Module,
        *,
        directory: Path | None,
        built_here: bool,
        device_map: DeviceMap | None,
        report: LoadReport,
    ) -> None:
        """Runs after the tensors are in place and before the train/eval mode is set."""
