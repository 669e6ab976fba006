"""The core load pipeline: a checkpoint into any ``nn.Module``, read top to bottom in :func:`load`.

The spine of a load: :class:`~fastload.core.plan.load_options.LoadOptions` (every option, validated
once by the entry) -> :class:`~fastload.core.plan.load_plan.LoadPlan` (made once: each tensor's
source, destination and mode) -> allocate -> read -> finish ->
:class:`~fastload.core.plan.report.LoadReport`. The phases, each timed in the report:

1. **resolve** the checkpoint (one file, a directory, a sharded index, or an in-memory state
   dict) and read every header (:mod:`fastload.core.checkpoint.files`);
2. build the **skeleton**: parameters on ``meta``, buffers real
   (:mod:`fastload.core.model.skeleton`);
3. **plan**: map checkpoint names onto model names and apply the key policies, give each tensor
   its destination (:mod:`fastload.core.plan.placement`) and its mode: view, copy, convert, slice,
   merge, offload; or initialize or keep it (:mod:`fastload.core.plan.planning`). The report's
   matching and byte counts come from the plan;
4. **allocate** every destination once, on its final device and dtype, as the plan says;
5. **read**: one Rust copy per file (:func:`fastload.core.basics.engine.copy_into`) fills all of
   that file's destinations in parallel;
6. **finish**: swap the new tensors into the model and initialize what the checkpoint lacks
   (:mod:`fastload.core.finishing`), then dispatch, tensor-parallel wrapping, the model family's own
   finishing (:mod:`fastload.core.plan.hooks`), and the train/eval mode.

Nothing in the model changes before every copy has succeeded, and a failure while swapping or
initializing puts the original tensors back, so a module passed in is never left half-loaded by a
bad checkpoint. The steps after that are not rolled back if they fail.

This module knows torch modules only and none of its callers: the model family's behaviour comes
through the hooks the entry chose (:class:`~fastload.core.plan.target.Target`,
:mod:`fastload.core.plan.hooks`), and the steps across ranks, gradient checkpointing and the record
a reload needs through the steps it supplies (:class:`~fastload.core.plan.steps.LoadSteps`). Each
phase is one named function below :func:`load`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload.core.checkpoint.opened import OpenCheckpoint, main_dtype
from fastload.core.checkpoint.pickle_file import StateDictFile
from fastload.core.devices.device_map import DeviceMap
from fastload.core.devices.dispatch import dispatch
from fastload.core.devices.resolution import resolve_for_load
from fastload.core.finishing import resolve_duplicates, swap_in
from fastload.core.memory.budget import MemoryBudget, memory_budget
from fastload.core.memory.sharing import WarmUp
from fastload.core.model.skeleton import forget_constructor_values
from fastload.core.model.tying import tensor_slots
from fastload.core.phases import Clock, device_explicit, without_gc_pauses
from fastload.core.plan.hooks import FamilyShards, ModelHooks
from fastload.core.plan.load_options import LoadOptions
from fastload.core.plan.load_plan import LoadPlan
from fastload.core.plan.owned_memory import check_owned_memory
from fastload.core.plan.placement import Placement
from fastload.core.plan.planning import plan
from fastload.core.plan.report import LoadReport
from fastload.core.plan.steps import NO_STEPS, LoadSteps, RankGroup, TensorParallelLayout
from fastload.core.plan.target import Target
from fastload.core.reads.allocation import Fill, allocate
from fastload.core.reads.offload import dispatch_offloaded, offloaded_names
from fastload.core.reads.reading import fill_checkpoint
from fastload.core.reads.session import PartWarmUp, SessionPart, part_of
from fastload.core.store.source import open_source

logger = logging.getLogger("fastload")

__all__ = ["load"]


@dataclass
class _Opened:
    """The checkpoint opened, the dtype decided, the read-ahead started (phase "resolve")."""

    ckpt: OpenCheckpoint
    group: RankGroup | None
    #: the dtype asked for (``None``: each tensor's stored one), and the checkpoint's main one
    want: torch.dtype | None
    stored: torch.dtype | None
    budget: MemoryBudget
    warm_up: WarmUp | PartWarmUp
    part: SessionPart | None  # in a session: this load's part

    @property
    def source(self) -> str:
        location = self.ckpt.location
        return str(location.index or location.files[0])


@dataclass
class _Family:
    """The model family's part in this load: its hooks, and the destinations it made itself."""

    hooks: ModelHooks
    built_here: bool
    shards: FamilyShards | None

    @property
    def later(self) -> set[str]:
        return self.shards.later if self.shards is not None else set()


@dataclass
class _Planned:
    """The plan and what it was made under (phase "plan")."""

    load_plan: LoadPlan
    dmap: DeviceMap | None
    tp: TensorParallelLayout | None


@device_explicit
@without_gc_pauses
def load(
    target: Target,
    checkpoint: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    options: LoadOptions,
    *,
    steps: LoadSteps = NO_STEPS,
    seconds: dict[str, float] | None = None,
) -> tuple[nn.Module, LoadReport]:
    """Loads ``checkpoint`` (a local path, or a state dict) into ``target`` with ``options``
    (:class:`~fastload.core.plan.load_options.LoadOptions`, validated by the entry). ``steps`` are
    those the entry supplies (:class:`~fastload.core.plan.steps.LoadSteps`: a collective read,
    tensor parallelism, gradient checkpointing); ``seconds`` are phases already spent by the
    caller (resolving a model id), put first in the report."""
    steps.check(options)
    clock = Clock()
    clock.seconds.update(seconds or {})
    with clock.phase("resolve"):
        opened = _open(target, checkpoint, options, steps)
    with _every_rank_hears(opened, steps):  # a failure here on one rank stops every rank
        with clock.phase("skeleton"):
            module = _skeleton(target, opened)
        family = _family(target, module)
        was_training = module.training
        with clock.phase("plan"):
            planned = _plan(module, opened, family, options, steps)
        report = planned.load_plan.report
        with clock.phase("allocate"):
            by_file = allocate(
                planned.load_plan,
                opened.ckpt,
                opened.warm_up.mappings,
                threads=options.threads,
                budget=opened.budget,
                paced=options.read_ahead,
            )
    with clock.phase("read"):
        _read_phase(opened, by_file, report, options, steps)
        resolve_duplicates(planned.load_plan.groups)
    with clock.phase("finish"):
        _finish(module, opened, family, planned, options, steps)
        # a model fastload built is ready for inference; a module passed in keeps its mode
        module.train(options.gradient_checkpointing or (was_training and not family.built_here))
        _join_read_ahead(opened, report)
        if steps.record is not None:  # what a reload needs
            steps.record(module, planned.load_plan, opened.ckpt, options, opened.source)
    report.seconds = dict(clock.seconds)
    _describe(report, module, opened, planned, options)
    logger.info("%s", report.summary())
    return module, report


@contextmanager
def _every_rank_hears(opened: _Opened, steps: LoadSteps) -> Iterator[None]:
    """In a collective load, a failure between opening and reading on this rank is told to the
    other ranks, which wait for it in the read
    (:meth:`~fastload.core.plan.steps.RankSteps.abandon`)."""
    try:
        yield
    except Exception as e:
        if opened.group is None:
            raise
        steps.across_ranks.abandon(opened.group, e)
        raise


def _open(
    target: Target,
    checkpoint: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    options: LoadOptions,
    steps: LoadSteps,
) -> _Opened:
    """Opens the checkpoint (every header read), joins the group of a collective load, decides
    the dtype, and starts reading the files ahead where the tensors will be views of them."""

    def opener() -> OpenCheckpoint:
        o = options
        return open_source(checkpoint, o.read_mode, o.mmap, o.allow_pickle, o.storage_options)

    group = None
    if options.collective:  # every rank opens, then learns whether all did
        where = "tp_plan" if options.tp_plan is not None else "process_group"
        group, ckpt = steps.across_ranks.join(options.process_group, where, opener)
    else:
        ckpt = opener()
    want = options.dtype
    if want == "auto":
        # the model family's rule for a model built for this load (its hooks' auto_dtype); the
        # stored dtypes for any other model, and for a module passed in
        hooks_first = target.hooks if target.module is None else None
        want = hooks_first.auto_dtype(ckpt) if hooks_first is not None else None
    assert not isinstance(want, str)
    stored = main_dtype(ckpt)
    # the disk starts on the files now, and their pages are mapped, while the skeleton is
    # built and the load planned; only where the tensors will be views of the mappings
    views = options.views_possible and want in (None, stored) and options.read_ahead
    # what this process may still make resident (its cgroup's limit): read-ahead stays within
    # it, and a load that must own more is refused before it allocates (fastload.core.memory.budget)
    budget = memory_budget()
    # a load in a session (loads read together) reads ahead with it (fastload.core.reads.session)
    part = part_of(ckpt.files, alone=group is not None)
    warm = WarmUp if part is None else part.warm
    warm_up = warm(ckpt.files, options.mmap, views=views, budget=budget)
    return _Opened(ckpt, group, want, stored, budget, warm_up, part)


def _skeleton(target: Target, opened: _Opened) -> nn.Module:
    """The module passed in, or the skeleton built under the dtype of the load."""
    if target.module is not None:
        return target.module
    assert target.build is not None
    return target.build(opened.stored if opened.want is None else opened.want)


def _family(target: Target, module: nn.Module) -> _Family:
    """The hooks the entry chose for ``module``; for a model built here, the family prepares
    it and may make its own destinations (its own tensor-parallel parameters)."""
    hooks = target.hooks or target.choose_hooks(module)
    built_here = target.module is None
    shards = None
    if built_here:
        hooks.prepare(module)
        shards = hooks.shard(module)
    return _Family(hooks, built_here, shards)


def _plan(
    module: nn.Module, opened: _Opened, family: _Family, options: LoadOptions, steps: LoadSteps
) -> _Planned:
    """The device map, the tensor-parallel layout and the placement they make, then the plan
    (:func:`fastload.core.plan.planning.plan`), checked against the memory budget."""
    dmap = resolve_for_load(
        module,
        options.device_map,
        offload_folder=options.offload_folder,
        max_memory=options.max_memory,
        no_split=options.no_split_module_classes,
    )
    tp = None
    if options.tp_plan is not None and family.shards is None:
        tp = steps.across_ranks.layout(options.tp_plan, module, options.process_group)
    placement = Placement(
        device=options.device,
        dtype=opened.want,
        keep_fp32=family.hooks.keep_fp32(module, opened.want),
        skeleton_dtypes=family.built_here,
        device_map=dmap,
        tp=tp,
        provided=family.shards.tensors if family.shards is not None else None,
    )
    load_plan = plan(
        module,
        opened.ckpt,
        placement,
        options,
        source=opened.source,
        hooks=family.hooks,
        later=family.later,
    )
    check_owned_memory(load_plan, options.mmap, options.staging, opened.budget)
    return _Planned(load_plan, dmap, tp)


def _read_phase(
    opened: _Opened,
    by_file: dict[int, list[Fill]],
    report: LoadReport,
    options: LoadOptions,
    steps: LoadSteps,
) -> None:
    """Fills every destination: with the group in a collective load, else from storage."""
    group, pool = opened.group, options.staging
    if group is not None and group.world_size > 1:
        fills = [(f.name, f.tensor, f.selection) for i in sorted(by_file) for f in by_file[i]]
        exchange = steps.across_ranks.read(group, opened.ckpt, fills, options.threads)
        report.bytes_written = sum(t.numel() * t.element_size() for _, t, _ in fills)
        report.bytes_read = exchange.storage_bytes
        report.bytes_received = exchange.received_bytes
        report.rank, report.world_size = group.rank, group.world_size
    else:
        progress = options.progress if opened.part is None else opened.part.progress
        report.bytes_written = fill_checkpoint(
            opened.ckpt, by_file, threads=options.threads, progress=progress, pool=pool
        )
    report.staging_bytes = pool.peak_bytes
    report.bytes_staged_direct = pool.direct_bytes
    report.bytes_staged_cached = pool.cached_bytes
    pool.release()  # a pinned slab stays with the process for the next load


def _finish(
    module: nn.Module,
    opened: _Opened,
    family: _Family,
    planned: _Planned,
    options: LoadOptions,
    steps: LoadSteps,
) -> None:
    """Swaps the loaded tensors in and initializes the missing ones (all or nothing), then
    dispatches over the device map, adapts tensor-parallel modules, runs the family's own
    finishing and switches gradient checkpointing on when asked."""
    groups, hooks, report = planned.load_plan.groups, family.hooks, planned.load_plan.report
    swap_in(
        module,
        groups,
        report,
        offloaded=offloaded_names(groups) | family.later | planned.load_plan.operations,
        family=hooks.initialize,
        dropped=hooks.dropped_attributes(),
    )
    forget_constructor_values(module)
    dmap = planned.dmap
    if dmap is not None and dmap.has_disk:
        dispatch_offloaded(module, dmap, groups, opened.ckpt, mmap=options.mmap)
    elif dmap is not None:
        dispatch(module, dmap)
    if planned.tp is not None:
        _finish_tensor_parallel(module, planned.tp, options.process_group, report, steps)
    # a local checkpoint's directory (not a state dict's label, nor a prefix in object
    # storage: the entry that resolved one gives the family its own directory, if any)
    location = opened.ckpt.location
    local = isinstance(location.directory, Path) and not isinstance(
        opened.ckpt.files[0], StateDictFile
    )
    directory = location.directory if local else None
    hooks.finish(
        module, directory=directory, built_here=family.built_here, device_map=dmap, report=report
    )
    if options.gradient_checkpointing:
        assert steps.gradient_checkpointing is not None  # LoadSteps.check
        steps.gradient_checkpointing(module)


def _join_read_ahead(opened: _Opened, report: LoadReport) -> None:
    """Waits for the read-ahead, last: nothing before reads a view's bytes, so the pages were
    read and mapped beside the load."""
    warm_up = opened.warm_up
    warm_up.join()
    report.bytes_read_ahead += warm_up.mapped
    if warm_up.mappings:
        report.read_ahead = "the whole files, beside the skeleton build (they fit the budget)"
    report.memory_budget, report.memory_source = opened.budget.available, opened.budget.source


def _describe(
    report: LoadReport,
    module: nn.Module,
    opened: _Opened,
    planned: _Planned,
    options: LoadOptions,
) -> None:
    """The report's account of how the load went: modes, files, devices, dtype, class."""
    ckpt, dmap, want = opened.ckpt, planned.dmap, opened.want
    # Each file's way of reading: read_mode, or "torch.load(weights_only)" for a pickle file.
    modes = "+".join(dict.fromkeys(f.mode for f in ckpt.files))
    report.read_mode = f"{modes}+shared-mmap" if report.bytes_shared else modes
    report.files = [str(f) for f in ckpt.location.files]
    report.device = (
        str(options.device)
        if dmap is None
        else ", ".join(dict.fromkeys(dmap.as_strings().values()))
    )
    report.device_map = None if dmap is None else dmap.as_strings()
    report.dtype = "stored" if want is None else str(want).removeprefix("torch.")
    report.model_class = type(module).__name__


def _finish_tensor_parallel(
    module: nn.Module,
    tp: TensorParallelLayout,
    process_group: Any,
    report: LoadReport,
    steps: LoadSteps,
) -> None:
    steps.across_ranks.parallelize(module, tp, process_group)
    unused = tp.unused_patterns(s.name for s in tensor_slots(module))
    if unused:
        logger.warning("tp_plan: patterns %s match no parameter of the model", unused)
    report.rank, report.world_size = tp.rank, tp.world_size
