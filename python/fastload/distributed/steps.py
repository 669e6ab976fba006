"""This package as steps of the core's pipeline (:class:`fastload.core.plan.steps.RankSteps`): the
entry of a load passes :data:`RANK_STEPS` in, so the core runs a collective read and
tensor-parallel slicing without importing this package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from torch import nn

from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.plan.steps import Fill
from fastload.distributed.collective import (
    Exchange,
    RankGroup,
    check_same_checkpoint,
    open_same,
    read_collectively,
)
from fastload.distributed.group import abandon
from fastload.distributed.tensor_parallel import TPLayout, layout_for, parallelize


class DistributedSteps:
    """Joins a group, reads collectively, lays out and adapts tensor-parallel modules."""

    def join(
        self, process_group: Any, where: str, opener: Callable[[], OpenCheckpoint]
    ) -> tuple[RankGroup, OpenCheckpoint]:
        group = RankGroup(process_group, where=where)
        return group, open_same(group, opener, "opening the checkpoint")

    def abandon(self, group: Any, failure: Exception) -> None:
        abandon(cast(RankGroup, group), failure)

    def read(
        self, group: Any, ckpt: OpenCheckpoint, fills: Sequence[Fill], threads: int | None
    ) -> Exchange:
        return read_collectively(cast(RankGroup, group), ckpt, fills, threads=threads)

    def layout(self, tp_plan: Any, model: nn.Module, process_group: Any) -> TPLayout:
        return layout_for(tp_plan, model, process_group)

    def parallelize(self, model: nn.Module, layout: Any, process_group: Any) -> None:
        parallelize(model, cast(TPLayout, layout), process_group)

    def group(self, process_group: Any, where: str) -> RankGroup:
        return RankGroup(process_group, where=where)

    def same_checkpoint(self, group: Any, ckpt: OpenCheckpoint) -> None:
        check_same_checkpoint(cast(RankGroup, group), ckpt)


#: the steps every entry of a load passes to the core (:class:`fastload.core.plan.steps.LoadSteps`)
RANK_STEPS = DistributedSteps()
