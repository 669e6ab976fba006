"""``fastload.reload``: a new checkpoint into a model fastload loaded, in place.

The reload keeps what the load decided (:mod:`fastload.reloading.record`): the same stored
tensor, or part of it, fills the same model tensor, converted to the dtype it has, on the device
it is on. Every byte goes into the memory the model already holds: each parameter and buffer keeps
its ``data_ptr`` (CUDA graphs, optimizers, hooks and views stay valid), and a tie stays one tensor.

In order:

1. **check**: the new checkpoint's headers are read and validated, and every tensor the model
   takes from it is checked by name, shape and dtype against the record and the model's tensor;
   a checkpoint that does not fit is refused (``CheckpointError``, ``ModelMismatchError``) naming
   every tensor that does not, before a byte is written, as is one that stores a tie of the model
   under two names with different values (:mod:`fastload.reloading.ties`);
2. **skip**: where the model's checkpoint and the new one both carry a digest of a tensor
   (:mod:`fastload.core.checkpoint.digests`) and the two are equal, it is neither read nor copied;
3. **read**: each file's tensors are filled by the copy engine (CPU destinations directly,
   :func:`fastload.core.reads.reading.fill`; others through the staging ring,
   :func:`fastload.core.reads.streaming.stream_into`): into the model's tensors, or with
   ``atomic=True`` into new tensors first, checked against the digests as read
   (:mod:`fastload.reloading.verify`), then copied into the model's in one step that a Ctrl-C
   does not interrupt.

Reloads of one model run one at a time (the lock of its record).

A failure after the first write into the model (a file truncated meanwhile, a read error, an
interrupt) raises :class:`~fastload.core.basics.errors.ReloadError` naming the tensors that may hold
new bytes, and marks the model: neither it nor any of its submodules runs (called, or through
``forward``) until a reload succeeds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn

from fastload.core.basics.arguments import check_bool
from fastload.core.basics.errors import (
    RequestError,
    UnsupportedError,
)
from fastload.core.basics.threads import check_threads
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.plan.steps import RankSteps
from fastload.core.reads import reading as reader
from fastload.core.store.object_store import is_url
from fastload.core.store.source import open_source
from fastload.reloading import guard as guard
from fastload.reloading import verify as verifier
from fastload.reloading.checks import Write, check_fit, drop_unchanged, label, nbytes
from fastload.reloading.files import fill_files as _fill_files
from fastload.reloading.ranks import Ranks, plan_of
from fastload.reloading.record import (
    LoadRecord,
    checkpoint_digests,
    one_at_a_time,
    record_of,
)
from fastload.reloading.report import ReloadReport
from fastload.reloading.ties import refuse_differing_ties

__all__ = ["ReloadReport", "Source", "reload"]

#: what a reload reads: a local path, an object storage URL or a state dict
Source = str | os.PathLike[str] | Mapping[str, torch.Tensor]


#: fills ``{file index: items}``, adding each file index to the list before its first write
_Fill = Callable[[dict[int, list[reader.FillItem]], list[int]], None]


@one_at_a_time
def reload(
    model: nn.Module,
    source: Source,
    *,
    atomic: bool = False,
    skip_unchanged: bool = True,
    verify: bool = False,
    threads: int | None = None,
    storage_options: Mapping[str, object] | None = None,
    resolve: Callable[[Source], Source] | None = None,
    process_group: Any = None,
    steps: RankSteps | None = None,
) -> ReloadReport:
    """Writes the checkpoint ``source`` (a local path, an object storage URL or a state dict)
    into ``model`` in place. The public entry, :func:`fastload.reload` (which also resolves model
    ids: ``resolve``, called once the model and the arguments are checked), documents the
    arguments, what it returns and what it raises. With ``process_group``, the ranks of the group
    reload together through the collective read of ``steps`` (:mod:`fastload.reloading.ranks`).
    """
    start = time.perf_counter()
    ranks = None if process_group is None else Ranks(steps, process_group)
    # across ranks, every rank's checks end in one agreement: one error on all, or all read
    with ranks.agreeing() if ranks is not None else nullcontext():
        record = record_of(model) if isinstance(model, nn.Module) else None
        if record is None:
            raise RequestError(
                f"reload needs a model that fastload.from_pretrained loaded; got a "
                f"{type(model).__name__} it did not load (load it once with from_pretrained)"
            )
        if record.unsupported is not None:
            raise UnsupportedError(f"this model cannot be reloaded: {record.unsupported}")
        check_bool(atomic, "atomic", where="reload")
        check_bool(skip_unchanged, "skip_unchanged", where="reload")
        check_bool(verify, "verify", where="reload")
        if verify and not atomic:
            raise RequestError(
                "reload(verify=True) checks the staged bytes before they are committed: pass "
                "atomic=True too (in place, the bytes would already be in the model)"
            )
        threads = record.threads if threads is None else threads
        if storage_options is None and is_url(source):
            storage_options = record.storage_options
        check_threads(threads, "reload")
        if ranks is not None and not isinstance(source, (str, os.PathLike)):
            raise RequestError(
                "reload(process_group=...) reads a checkpoint's files together; a state dict "
                "is in each rank's memory already: reload it without process_group"
            )
        if resolve is not None:
            source = resolve(source)
        # Positioned reads whatever read_mode the load used: a file truncated while a mapping of
        # it is read kills the process (SIGBUS), where a short read is an error naming the file.
        ckpt = open_source(source, "pread", "copy", record.allow_pickle, storage_options)
        report = ReloadReport(source=label(ckpt), atomic=atomic)
        report.files = [str(f) for f in ckpt.location.files]
        writes = check_fit(model, record, ckpt)
        new_digests = checkpoint_digests(ckpt)
        if verify and not new_digests:
            raise RequestError(
                f"{report.source}: reload(verify=True) checks the bytes against the digests the "
                "files record, and these record none (save them with digests=True)"
            )
        refuse_differing_ties(  # the tied tensors it reads, each rank reads itself
            model, record, ckpt, new_digests, lambda w: _fill_files(ckpt, w, threads, []),
            report.source,
        )  # fmt: skip
        if skip_unchanged:
            writes = drop_unchanged(writes, record.digests, new_digests, ckpt, report)
        report.tensors_read = len(writes)
        report.bytes_read = sum(n for w in writes for _, _, n in w.parts)
        report.bytes_written = sum(nbytes(w.dest) for w in writes)
        if atomic:
            _check_staging(writes, ckpt, new_digests if verify else {}, report)
        if ranks is not None:
            items = [(p.stored, t, p.selection) for w in writes for p, t, _ in w.parts]
            ranks.plan = plan_of(ckpt, items, new_digests, [atomic, skip_unchanged, verify], verify)

    def fill(by_file: dict[int, list[reader.FillItem]], started: list[int]) -> None:
        if ranks is None:
            _fill_files(ckpt, by_file, threads, started)
        else:  # every byte read once across the group
            try:
                ranks.fill(ckpt, by_file, threads)
            except UnsupportedError:
                raise  # the collective read refuses (a source it cannot read) before writing
            except BaseException:
                started.extend(by_file)
                raise

    if ranks is not None:
        ranks.join(ckpt)

    def done() -> None:  # the model holds the new checkpoint whole
        guard.unmark(record)
        record.digests, record.names, record.source = new_digests, set(ckpt.tensors), report.source

    if atomic:
        named = None if ranks is None else partial(ranks.read_by, ckpt)  # who read the bytes
        digests = new_digests if verify else {}
        _atomic(model, record, ckpt, writes, digests, fill, report, done, named)
    else:
        _in_place(model, record, ckpt, writes, fill)
        done()
    report.seconds = time.perf_counter() - start
    return report


def _by_file(
    pairs: list[tuple[Write, list[torch.Tensor]]],
) -> dict[int, list[reader.FillItem]]:
    """The copies to make per file index: each part into its target."""
    out: dict[int, list[reader.FillItem]] = {}
    for write, targets in pairs:
        for (part, _, _), target, index in zip(write.parts, targets, write.file_of, strict=True):
            out.setdefault(index, []).append((part.stored, target, part.selection))
    return out


def _in_place(
    model: nn.Module,
    record: LoadRecord,
    ckpt: OpenCheckpoint,
    writes: list[Write],
    fill: _Fill,
) -> None:
    """Fills the model's tensors directly; a failure after the first write marks the model."""
    by_file = _by_file([(w, [t for _, t, _ in w.parts]) for w in writes])
    started: list[int] = []
    try:
        fill(by_file, started)
    except BaseException as exc:
        if not started:
            raise
        names = [w.entry.name for w in writes if set(w.file_of) & set(started)]
        guard.fail(model, record, names, exc, f"reading {label(ckpt)}")


def _check_staging(
    writes: list[Write],
    ckpt: OpenCheckpoint,
    new_digests: Mapping[str, str],
    report: ReloadReport,
) -> None:
    """``MemoryBudgetError`` unless the staged copies (and what verifying them takes) fit."""
    need: dict[torch.device, int] = {}
    for write in writes:
        for _, target, _ in write.parts:
            need[target.device] = need.get(target.device, 0) + nbytes(target)
    report.bytes_staged = sum(need.values())
    items = [(p.stored, t, p.selection) for w in writes for p, t, _ in w.parts]
    verifier.add_scratch(need, items, ckpt, new_digests)  # whole stored tensors, to hash
    guard.check_staging_memory(need, label(ckpt), [t for w in writes for _, t, _ in w.parts])


def _atomic(
    model: nn.Module,
    record: LoadRecord,
    ckpt: OpenCheckpoint,
    writes: list[Write],
    new_digests: Mapping[str, str],
    fill: _Fill,
    report: ReloadReport,
    done: Callable[[], None],
    named: Callable[[str], str] | None = None,
) -> None:
    """Reads every new tensor into memory of its own (its room checked by
    :func:`_check_staging`), checks it against ``digests`` (none: no check), then commits and
    runs ``done``; a Ctrl-C during the commit is delivered after ``done``. ``named``: how a
    tensor whose digest fails is named (across ranks: the ranks that read its bytes)."""
    staged = [(w, [torch.empty_like(t, memory_format=torch.contiguous_format)
                   for _, t, _ in w.parts]) for w in writes]  # fmt: skip
    try:
        by_file = _by_file(staged)
        if new_digests:
            by_file, report.tensors_verified = verifier.read_verified(
                by_file, ckpt, new_digests, lambda w: fill(w, []), named
            )
        fill(by_file, [])
    except BaseException as exc:
        exc.add_note("fastload.reload(atomic=True): nothing was written; the model is unchanged")
        raise
    pairs = [
        (target, tensor)
        for write, tensors in staged
        for (_, target, _), tensor in zip(write.parts, tensors, strict=True)
    ]
    # The interrupt held back is raised once the block is done, outside the try: a commit that
    # completed is not marked torn by it.
    with guard.sigint_deferred(
        "fastload.reload(atomic=True): the interrupt came during the commit, which completed: "
        "the model holds the new weights whole"
    ):
        try:
            _commit(pairs)
        except BaseException as exc:
            names = [w.entry.name for w in writes]
            guard.fail(model, record, names, exc, "committing the staged tensors")
        done()


def _commit(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies each staged tensor into its target: the CPU's on every core (one tensor's copy
    uses one), an accelerator's on the calling thread, on its current stream (queued, and
    ordered with the staged memory's allocation)."""

    def copy(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        with torch.no_grad():
            pair[0].copy_(pair[1])

    on_cpu = [p for p in pairs if p[0].device.type == "cpu"]
    workers = max(1, min(os.cpu_count() or 1, 16, len(on_cpu)))
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(copy, on_cpu))
    for pair in pairs:
        if pair[0].device.type != "cpu":
            copy(pair)
