"""The steps of a load that packages beside the core supply, passed in by the entry of the load.

A collective load reads with the other ranks of a group, a tensor-parallel load slices by a plan
and adapts the modules afterwards (both :mod:`fastload.distributed`), and
``gradient_checkpointing=True`` switches checkpointing on (:mod:`fastload.training`). Those
packages use the core's leaves (errors, checkpoint records, dtypes, arguments); the core never
imports them back. The entry of a load hands them in as :class:`LoadSteps`, as it hands in a model
family's hooks (:mod:`fastload.core.plan.hooks`), so dependencies between the packages point one
way. A load that asks for a step its entry did not supply is refused before anything is opened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from fastload.core.basics.errors import UnsupportedError

if TYPE_CHECKING:
    from fastload.core.checkpoint.opened import OpenCheckpoint
    from fastload.core.plan.load_options import LoadOptions

#: one destination of a collective read: (stored name, destination tensor, selection)
Fill = tuple[str, torch.Tensor, Any]


class RankGroup(Protocol):
    """This process's place in the group of a collective load."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank (picklable), in rank order."""


class Exchange(Protocol):
    """What a collective read did: bytes this rank read from storage, bytes it received."""

    @property
    def storage_bytes(self) -> int: ...

    @property
    def received_bytes(self) -> int: ...

    @property
    def dealt(self) -> Sequence[Any]:
        """Every chunk of the read, each with ``file``, ``start``, ``stop`` (file offsets) and
        the ``owner`` rank that read it from storage."""


class TensorParallelLayout(Protocol):
    """This rank's part of every tensor under a tensor-parallel plan."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def selection(self, name: str, shape: Sequence[int]) -> Any:
        """The part of the full-size tensor ``name`` this rank holds (``None``: all of it)."""

    def unused_patterns(self, names: Iterable[str]) -> list[str]:
        """The plan's patterns that match none of ``names``."""


class RankSteps(Protocol):
    """The steps of a load across ranks (:class:`fastload.distributed.steps.DistributedSteps`)."""

    def join(
        self, process_group: Any, where: str, opener: Callable[[], OpenCheckpoint]
    ) -> tuple[RankGroup, OpenCheckpoint]:
        """This rank's group and the checkpoint ``opener`` opens on this rank, once every rank
        is known to have opened the same checkpoint (a rank that failed to open it fails every
        rank; ``where``: the option that made the load collective, for error messages)."""

    def abandon(self, group: RankGroup, failure: Exception) -> None:
        """Raises the error every rank raises when ``failure`` stopped this rank after
        :meth:`join` and before :meth:`read`: the others learn of it in their read's first
        exchange instead of waiting for it."""

    def read(
        self, group: RankGroup, ckpt: OpenCheckpoint, fills: Sequence[Fill], threads: int | None
    ) -> Exchange:
        """Fills ``fills`` with the group: this rank reads its share of the bytes from storage
        and receives the rest."""

    def layout(self, tp_plan: Any, model: nn.Module, process_group: Any) -> TensorParallelLayout:
        """This rank's layout under ``tp_plan`` for the full-size ``model``."""

    def parallelize(
        self, model: nn.Module, layout: TensorParallelLayout, process_group: Any
    ) -> None:
        """Adapts the modules holding shards, once they are loaded, to compute their part."""

    # A reload across ranks (fastload.reloading.ranks) agrees on every rank's checks in a
    # group of its own before comparing the checkpoints: the steps below, not join.

    def group(self, process_group: Any, where: str) -> RankGroup:
        """This rank's group, before any checkpoint is opened."""

    def same_checkpoint(self, group: RankGroup, ckpt: OpenCheckpoint) -> None:
        """``CheckpointError`` on every rank unless every rank of ``group`` opened a checkpoint
        of the same layout (tensors, dtypes, shapes, offsets)."""


class Recorder(Protocol):
    """What a load leaves beside the model it made, for the packages that use it later (a reload:
    :func:`fastload.reloading.record.remember`)."""

    def __call__(
        self,
        module: nn.Module,
        load_plan: Any,
        ckpt: OpenCheckpoint,
        options: LoadOptions,
        source: str,
    ) -> None:
        """Records what the load of ``module`` decided (``load_plan``: its ``LoadPlan``)."""


@dataclass(frozen=True)
class LoadSteps:
    """The steps an entry supplies (``None``: not available to its loads)."""

    #: the collective read and tensor-parallel slicing (``process_group=``, ``tp_plan=``)
    ranks: RankSteps | None = None
    #: switches gradient checkpointing on for a loaded model (``gradient_checkpointing=True``)
    gradient_checkpointing: Callable[[nn.Module], object] | None = None
    #: records what the load decided, beside the model (what ``fastload.reload`` needs)
    record: Recorder | None = None

    def check(self, options: LoadOptions) -> None:
        """``UnsupportedError`` when ``options`` ask for a step this entry did not supply."""
        if options.collective and self.ranks is None:
            raise UnsupportedError(
                "process_group and tp_plan: this entry of a load supplies no collective read"
            )
        if options.gradient_checkpointing and self.gradient_checkpointing is None:
            raise UnsupportedError(
                "gradient_checkpointing: this entry of a load cannot switch it on"
            )

    @property
    def across_ranks(self) -> RankSteps:
        """:attr:`ranks`, known to be supplied (:meth:`check`)."""
        assert self.ranks is not None
        return self.ranks


#: an entry that supplies none of the steps (loads on one process, without checkpointing)
NO_STEPS = LoadSteps()
