"""The group of a collective load, and its rule that no rank is left waiting.

:class:`RankGroup` is this process's place in a ``torch.distributed`` group. Every step of a
collective load that can fail on one rank alone (opening the checkpoint: a store that cannot be
reached from this node, credentials it refuses; reading a chunk: a store error, an object
replaced mid-load) runs through :func:`together` or sends its status before its data
(:mod:`fastload.distributed.collective`): the ranks learn of a failure in the next collective
call they make anyway, and every rank raises the same error, which names the rank and the cause.
A rank that dies (or is killed) breaks the group's connections: the exchange then fails on the
others at once, as a :class:`~fastload.core.basics.errors.FastloadIOError` saying so, rather than
wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from fastload.core.basics import errors
from fastload.core.basics.errors import FastloadError, FastloadIOError, RequestError

T = TypeVar("T")


class RankGroup:
    """A ``torch.distributed`` process group (``None``: the default one) and this process's
    place in it."""

    def __init__(self, group: Any = None, *, where: str = "process_group") -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RequestError(
                f"{where}: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first (torchrun does it for you)"
            )
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise RequestError(f"{where}: this process is not a member of the group")
        backend = str(dist.get_backend(group)).lower()
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank``."""
        if self.group is None:
            return rank
        return int(self.dist.get_global_rank(self.group, rank))

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order."""
        out: list[Any] = [None] * self.world_size
        try:
            self.dist.all_gather_object(out, value, group=self.group)
        except RuntimeError as e:
            raise self.lost(e, "the ranks exchanged their state") from e
        return out

    def broadcast(self, buffer: torch.Tensor, owner: int) -> None:
        try:
            self.dist.broadcast(buffer, src=self.global_rank(owner), group=self.group)
        except RuntimeError as e:
            raise self.lost(e, f"rank {owner} sent a chunk") from e

    def largest(self, flag: torch.Tensor) -> None:
        """``flag`` (on the group's device) becomes the largest of every rank's, in place."""
        try:
            self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise self.lost(e, "the ranks said whether they had read their chunks") from e

    def send_each(self, parts: dict[int, torch.Tensor], tag: int) -> None:
        """Sends ``parts[r]`` to each rank ``r``, all at once."""
        try:
            works = [
                self.dist.isend(part, dst=self.global_rank(r), group=self.group, tag=tag)
                for r, part in parts.items()
            ]
            for work in works:
                work.wait()
        except RuntimeError as e:
            raise self.lost(e, "this rank sent a chunk") from e

    def receive(self, buffer: torch.Tensor, owner: int, tag: int) -> None:
        """Receives into ``buffer`` what :meth:`send_each` of rank ``owner`` sends this rank."""
        try:
            self.dist.recv(buffer, src=self.global_rank(owner), group=self.group, tag=tag)
        except RuntimeError as e:
            raise self.lost(e, f"rank {owner} sent a chunk") from e

    def lost(self, cause: BaseException, doing: str) -> FastloadIOError:
        """The error of an exchange that broke: another rank is gone."""
        return FastloadIOError(
            f"collective load: rank {self.rank} of {self.world_size} lost the group while "
            f"{doing}: another rank stopped (it died, was killed or left the load) [rank-lost] "
            f"({cause})"
        )


def together(group: RankGroup, step: Callable[[], T], what: str) -> T:
    """``step()`` on this rank, then every rank learns whether it failed anywhere: if it did,
    every rank raises one error naming the rank(s) and the cause (its class that of the first
    failure, where fastload has it)."""
    failure: Exception | None = None
    value: Any = None
    try:
        value = step()
    except Exception as e:  # every rank must hear of it, whatever it is
        failure = e
    everyone = group.gather(_summary(failure))
    failed = [(r, summary) for r, summary in enumerate(everyone) if summary is not None]
    if failed:
        raise group_error(failed, what) from failure
    return value  # type: ignore[no-any-return]


def agree_on_plan(group: RankGroup, plan: str) -> list[str]:
    """Every rank's ``plan`` (a digest of what it will read), in rank order: the first collective
    call of a read. A rank whose planning failed makes this same call with its failure
    (:func:`abandon`): then every rank raises one error naming it."""
    everyone = group.gather(("plan", plan))
    failed = [(rank, value) for rank, (kind, value) in enumerate(everyone) if kind == "failed"]
    if failed:
        raise group_error(failed, "planning the load")
    return [value for _, value in everyone]


def abandon(group: RankGroup, failure: Exception) -> None:
    """Raises what every rank raises when ``failure`` stopped this rank between opening the
    checkpoint and reading it (building the model, planning, allocating): the others are waiting
    in :func:`agree_on_plan`, which this rank joins with its failure instead of a plan, so none
    is left waiting for the process group's timeout. Where every rank failed, each raises its
    own error (the same input fails alike everywhere); else every rank raises one error naming
    the ranks and the causes."""
    if group.world_size == 1:
        raise failure
    everyone = group.gather(("failed", _summary(failure)))
    failed = [(rank, value) for rank, (kind, value) in enumerate(everyone) if kind == "failed"]
    if len(failed) == group.world_size:
        raise failure
    raise group_error(failed, "planning the load") from failure


def on_every_rank(options: Any, step: Callable[[], T]) -> T:
    """``step()``; in a collective load (``options``: its :class:`~fastload.core.plan.load_options.
    LoadOptions`) whose group is up, through :func:`together`: fetching what comes before the
    checkpoint's headers (a model's config files from object storage) fails every rank alike."""
    import torch.distributed as dist

    if not options.collective or not (dist.is_available() and dist.is_initialized()):
        return step()
    where = "tp_plan" if options.tp_plan is not None else "process_group"
    group = RankGroup(options.process_group, where=where)
    return together(group, step, "fetching the checkpoint's config files")


def tell_every_rank(options: Any, failure: Exception) -> None:
    """Where ``failure`` stopped this rank of a collective load (``options``: its
    :class:`~fastload.core.plan.load_options.LoadOptions`) before it joined the others in opening
    the checkpoint (resolving the model's class, reading its config), raises what every rank raises:
    the others wait in that opening (:func:`together`), which this rank joins with its failure
    instead, so none waits for the process group's timeout and every rank names it and its
    cause. Returns (the caller raises ``failure``) outside a collective load whose group is up,
    alone in its group, or for a failure every rank already heard of."""
    import torch.distributed as dist

    if getattr(failure, "every_rank_knows", False) or not options.collective:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    where = "tp_plan" if options.tp_plan is not None else "process_group"
    group = RankGroup(options.process_group, where=where)
    if group.world_size == 1:
        return
    mine = _summary(failure)
    assert mine is not None
    everyone = group.gather((mine[0], f"before opening the checkpoint: {mine[1]}"))
    failed = [(rank, summary) for rank, summary in enumerate(everyone) if summary is not None]
    if len(failed) == group.world_size:  # the same input fails alike everywhere
        return
    raise group_error(failed, "opening the checkpoint") from failure


def _summary(failure: BaseException | None) -> tuple[list[str], str] | None:
    """What the other ranks need of a failure: its class's lineage, and its message."""
    if failure is None:
        return None
    return [c.__name__ for c in type(failure).__mro__], str(failure) or type(failure).__name__


def group_error(failed: list[tuple[int, tuple[list[str], str]]], what: str) -> FastloadError:
    """The one error every rank raises when ``what`` failed on the ranks ``failed`` (rank, and
    the :func:`_summary` of its failure)."""
    lineage, _ = failed[0][1]
    cls: type[FastloadError] = FastloadError
    for name in lineage:  # the most specific class of fastload's hierarchy the failure has
        found = getattr(errors, name, None)
        if isinstance(found, type) and issubclass(found, FastloadError):
            cls = found
            break
    else:
        if "OSError" in lineage:
            cls = FastloadIOError
    causes = "; ".join(f"rank {rank}: {message}" for rank, (_, message) in failed)
    who = ", ".join(str(rank) for rank, _ in failed)
    error = cls(f"collective load: {what} failed on rank {who}, so every rank stops ({causes})")
    error.every_rank_knows = True  # type: ignore[attr-defined]
    return error


__all__ = [
    "RankGroup",
    "abandon",
    "agree_on_plan",
    "group_error",
    "on_every_rank",
    "tell_every_rank",
    "together",
]
