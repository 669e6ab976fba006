"""``reload(..., process_group=pg)``: the ranks of a group reload one checkpoint together.

Each rank checks the new checkpoint against its own model and decides what it skips as unchanged,
exactly as a reload on one process does. Then the ranks agree (:meth:`Ranks.agreeing`, one
gather): a rank that refused the reload (a checkpoint that does not fit its model, a source it
cannot open, too little memory to stage) stops every rank with one error naming it, before any
rank reads a data byte; so do ranks that would read different tensors (their models' digests
differ) or whose checkpoints record different digests, or that pass different options. Only then
are the checkpoints' layouts compared (:meth:`fastload.core.plan.steps.RankSteps.same_checkpoint`,
as a collective load compares them) and the ranks read:
every fill of the reload, in place, staged (``atomic=True``) or whole to be hashed
(``verify=True``), goes through the collective read the entry supplies
(:meth:`fastload.core.plan.steps.RankSteps.read`), so each changed tensor's bytes are read once
across the group, each rank reading about 1/N of them, and exchanged.

The core never imports :mod:`fastload.distributed`: the public entry passes its steps in.
"""

from __future__ import annotations

import builtins
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from fastload.core.basics import errors
from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    RequestError,
    UnsupportedError,
)
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.model.keys import format_names
from fastload.core.plan.steps import RankGroup, RankSteps
from fastload.core.reads.reading import FillItem
from fastload.core.store.object_store import is_remote

__all__ = ["Ranks"]

#: where the errors of a reload across ranks say they come from
WHERE = "fastload.reload(process_group=...)"


class Ranks:
    """This rank's part in a reload with the other ranks of ``process_group``."""

    def __init__(self, steps: RankSteps | None, process_group: Any) -> None:
        if steps is None:
            raise UnsupportedError(
                "reload(process_group=...): this entry of a reload supplies no collective read"
            )
        self.steps = steps
        self.process_group = process_group
        self.group: RankGroup = steps.group(process_group, "reload(process_group=...)")
        #: what this rank plans, compared across ranks by :meth:`agreeing` (set in its block)
        self.plan: dict[str, Any] = {}
        self.joined: RankGroup | None = None
        #: every rank's file paths (set by :meth:`join`), and the chunks read so far, each with
        #: the rank that read it from storage: who read a tensor's bytes (:meth:`read_by`)
        self.paths: list[list[str]] = []
        self.dealt: list[Any] = []

    @contextmanager
    def agreeing(self) -> Iterator[None]:
        """Runs the block (this rank's checks and plan), then agrees with every rank: an error
        in any rank's block, or plans that differ, raise one error on every rank."""
        try:
            yield
        except BaseException as exc:
            everyone = self.group.gather(("error", type(exc).__name__, str(exc)))
            failed = [(r, got) for r, got in enumerate(everyone) if got[0] == "error"]
            agreed = _agreed(failed, self.group.world_size)
            if not isinstance(exc, Exception):  # a Ctrl-C stays one: the others got the error
                exc.add_note(str(agreed))
                raise
            raise agreed from exc
        everyone = self.group.gather(("ok", self.plan))
        failed = [(r, got) for r, got in enumerate(everyone) if got[0] == "error"]
        if failed:
            raise _agreed(failed, self.group.world_size)
        _refuse_differing_plans([got[1] for got in everyone])

    def join(self, ckpt: OpenCheckpoint) -> None:
        """Joins the read: every rank opened a checkpoint of the same layout (else a
        ``CheckpointError`` on every rank)."""
        try:
            self.steps.same_checkpoint(self.group, ckpt)
        except CheckpointError as exc:  # raised on every rank alike
            raise CheckpointError(f"{WHERE}: {exc}. Nothing was written on any rank") from exc
        self.paths = self.group.gather([str(f.path) for f in ckpt.files])
        self.joined = self.group

    def read_by(self, ckpt: OpenCheckpoint, name: str) -> str:
        """Stored tensor ``name`` and where its bytes came from in the group's last reads: the
        ranks that read them from storage, and their files (a digest that fails names the copy
        that is corrupt, not this rank's own)."""
        stored = ckpt.tensors[name]
        start = getattr(ckpt.files[stored.file], "data_start", 0) + stored.begin
        stop = start + stored.nbytes
        owners = sorted(
            {
                c.owner
                for c in self.dealt
                if c.file == stored.file and c.start < stop and c.stop > start
            }
        )
        if not owners or not self.paths:
            return f"{ckpt.file_path(stored)}: tensor {name!r}"
        where = ", ".join(f"rank {r} from {self.paths[r][stored.file]}" for r in owners)
        return f"tensor {name!r} (its bytes read by {where})"

    def fill(
        self, ckpt: OpenCheckpoint, by_file: Mapping[int, list[FillItem]], threads: int | None
    ) -> None:
        """Fills every item with the group (each rank calls it with the same stored names)."""
        assert self.joined is not None
        fills = [item for index in sorted(by_file) for item in by_file[index]]
        try:
            exchange = self.steps.read(self.joined, ckpt, fills, threads)
            self.dealt = list(exchange.dealt)
        except UnsupportedError as exc:  # refused alike on every rank, before any byte is read
            raise UnsupportedError(
                f"{WHERE}: {exc}. Reload without process_group (each rank reads what it holds). "
                "Nothing was written on any rank"
            ) from exc


def plan_of(
    ckpt: OpenCheckpoint,
    items: Sequence[FillItem],
    new_digests: Mapping[str, str],
    options: Sequence[object],
    verify: bool,
) -> dict[str, Any]:
    """What the ranks must agree on: the stored tensors read, the new checkpoint's digests,
    where it is read from, the options, and (``verify=True``, whose reads follow how each copy is
    held) the dtypes, devices and whether each copy is sliced."""
    held = [
        (name, selection is None, str(t.dtype), t.device.type, t.is_contiguous())
        for name, t, selection in items
    ]
    digests = hashlib.sha256(repr(sorted(new_digests.items())).encode()).hexdigest()
    return {
        "reads": sorted({name for name, _, _ in items}),
        "digests": digests,
        "remote": any(is_remote(f) for f in ckpt.files),
        "options": list(options),
        "held": hashlib.sha256(repr(held).encode()).hexdigest() if verify else "",
    }


def _refuse_differing_plans(plans: list[dict[str, Any]]) -> None:
    """One error on every rank where a rank's plan differs from rank 0's."""
    first = plans[0]
    for rank, plan in enumerate(plans[1:], start=1):
        if plan["options"] != first["options"]:
            raise RequestError(
                f"{WHERE}: rank {rank} passed other options than rank 0 (atomic, skip_unchanged, "
                f"verify: {plan['options']} against {first['options']}); every rank must reload "
                "the same way. Nothing was written on any rank"
            )
        if plan["remote"] != first["remote"]:
            kinds = {True: "an object storage URL", False: "local files"}
            raise CheckpointError(
                f"{WHERE}: rank {rank} reads {kinds[plan['remote']]}, rank 0 "
                f"{kinds[first['remote']]}; every rank must reload copies of one checkpoint. "
                "Nothing was written on any rank"
            )
        if plan["digests"] != first["digests"]:
            raise CheckpointError(
                f"{WHERE}: the checkpoint of rank {rank} records other digests than rank 0's: "
                "they are not copies of one checkpoint. Nothing was written on any rank"
            )
        if plan["reads"] != first["reads"]:
            mine, theirs = set(plan["reads"]), set(first["reads"])
            raise CheckpointError(
                f"{WHERE}: rank {rank} would read other tensors than rank 0 (only rank {rank}: "
                f"{format_names(sorted(mine - theirs)) or 'none'}; only rank 0: "
                f"{format_names(sorted(theirs - mine)) or 'none'}): the digests of their models "
                "differ (a rank reloaded or changed its model alone). Reload with "
                "skip_unchanged=False to read every tensor. Nothing was written on any rank"
            )
        if plan["held"] != first["held"]:
            raise RequestError(
                f"{WHERE}: rank {rank} holds its tensors otherwise than rank 0 (dtypes, devices "
                "or slices differ), so verify=True would read them otherwise; every rank must "
                "hold the model as the same load made it. Nothing was written on any rank"
            )


def _agreed(failed: list[tuple[int, Any]], world_size: int) -> BaseException:
    """The error every rank raises when ranks ``failed`` (rank, ("error", class, message)):
    the first one's class (a FastloadError or a built-in exception; else FastloadError) and
    message, naming the rank."""
    rank, (_, name, message) = failed[0]
    others = [str(r) for r, _ in failed[1:]]
    also = f" (ranks {', '.join(others)} failed too)" if others else ""
    text = (
        f"{WHERE}: rank {rank} of {world_size} failed{also}, so no rank reloaded; nothing was "
        f"written on any rank. Rank {rank}: {name}: {message}"
    )
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, FastloadError)):
        cls = getattr(builtins, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = FastloadError
    try:
        return cls(text)
    except Exception:  # a class whose constructor takes other arguments
        return FastloadError(text)
