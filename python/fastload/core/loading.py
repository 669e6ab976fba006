"""The core load pipeline: a checkpoint into any ``nn.Module``, read top to bottom in :func:`load`.

The spine of a load: :class:`~fastload.core.load_options.LoadOptions` (every option, validated once
by the entry) -> :class:`~fastload.core.planning.LoadPlan` (made once: each tensor's source,
destination and mode) -> allocate -> read -> finish -> :class:`~fastload.core.report.LoadReport`.
The phases, each timed in the report:

1. **resolve** the checkpoint (one file, a directory, a sharded index, or an in-memory state
   dict) and read every header (:mod:`fastload.core.checkpoint`);
2. build the **skeleton**: parameters on ``meta``, buffers real (:mod:`fastload.core.skeleton`);
3. **plan**: map checkpoint names onto model names and apply the key policies, give each tensor
   its destination (:mod:`fastload.core.placement`) and its mode: view, copy, convert, slice, merge,
   offload; or initialize or keep it (:mod:`fastload.core.planning`). The report's matching and byte
   counts come from the plan;
4. **allocate** every destination once, on its final device and dtype, as the plan says;
5. **read**: one Rust copy per file (:func:`fastload.core.engine.copy_into`) fills all of that
   file's destinations in parallel;
6. **finish**: swap the new tensors into the model and initialize what the checkpoint lacks
   (:mod:`fastload.core.finishing`), then dispatch, tensor-parallel wrapping, the model family's own
   finishing (:mod:`fastload.core.hooks`), and the train/eval mode.

Nothing in the model changes before every copy has succeeded, and a failure while swapping or
initializing puts the original tensors back, so a module passed in is never left half-loaded by a
bad checkpoint. The steps after that are not rolled back if they fail.

This module knows torch modules only and none of its callers: the model family's behaviour comes
through the hooks the entry chose (:class:`Target`, :mod:`fastload.core.hooks`).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fastload.core import reading as reader
from fastload.core.allocation import Fill, allocate
from fastload.core.checkpoint import OpenCheckpoint
from fastload.core.device_map import DeviceMap, resolve_device_map
from fastload.core.devices import cpu_by_default
from fastload.core.dispatch import dispatch
from fastload.core.dtypes import CONVERTIBLE, parse_dtype
from fastload.core.errors import RequestError, UnsupportedError, from_os_error
from fastload.core.finishing import resolve_duplicates, swap_in
from fastload.core.hooks import ModelHooks
from fastload.core.load_options import LoadOptions
from fastload.core.memory import check_owned_memory, memory_budget
from fastload.core.object_store import is_remote
from fastload.core.offload import dispatch_offloaded, offloaded_names, require_accelerate
from fastload.core.pickle_file import StateDictFile
from fastload.core.placement import Destination, Placement, selected_shape
from fastload.core.planning import plan
from fastload.core.progress import byte_progress
from fastload.core.report import LoadReport
from fastload.core.sharing import WarmUp
from fastload.core.skeleton import build_skeleton, forget_constructor_values
from fastload.core.source import open_source
from fastload.core.streaming import StagingPool
from fastload.core.tying import tensor_slots
from fastload.distributed.collective import RankGroup, check_same_checkpoint, read_collectively
from fastload.distributed.tensor_parallel import TPLayout, layout_for, parallelize
from fastload.training.gradient_checkpointing import gradient_checkpointing_enable

logger = logging.getLogger("fastload")

__all__ = ["Destination", "Placement", "Target", "load", "plain_target", "selected_shape"]


@dataclass
class Target:
    """What a load fills: an already-built ``module`` (loaded in place, its train/eval mode kept)
    or a ``build`` function that makes the skeleton under a dtype (the model is then fastload's
    and ends in eval mode).

    The model family's hooks are chosen by the entry of the load: ``hooks`` when it knows the
    family up front, else ``choose_hooks`` is asked once the module exists (a factory's model);
    a plain ``nn.Module``'s by default."""

    module: nn.Module | None = None
    build: Callable[[torch.dtype | None], nn.Module] | None = None
    hooks: ModelHooks | None = None
    choose_hooks: Callable[[nn.Module], ModelHooks] = lambda module: ModelHooks()


def plain_target(
    model: Any,
    config: Any,
    model_kwargs: dict[str, Any],
    choose_hooks: Callable[[nn.Module], ModelHooks] | None = None,
) -> Target:
    """The target for an ``nn.Module`` passed in, or any module class or factory (called with
    ``**model_kwargs``, or ``(config, **model_kwargs)`` when ``config`` is given)."""
    if isinstance(model, nn.Module):
        if config is not None or model_kwargs:
            raise RequestError(
                "config and model keyword arguments only apply when fastload builds the model; "
                f"got an already-built {type(model).__name__} (and {sorted(model_kwargs)})"
            )
        target = Target(module=model)
    elif not callable(model):
        raise RequestError(
            "model must be an nn.Module class, a factory, a built module, a model id or "
            f"directory, or None; got {model!r}"
        )
    else:
        args = () if config is None else (config,)

        def build(dtype: torch.dtype | None) -> nn.Module:
            return build_skeleton(lambda: model(*args, **model_kwargs), dtype=dtype)

        target = Target(build=build)
    if choose_hooks is not None:
        target.choose_hooks = choose_hooks
    return target


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


_F = TypeVar("_F", bound=Callable[..., Any])
_gc_lock = threading.Lock()
_gc_paused = 0  # loads under way that paused the cyclic garbage collector
_gc_was_enabled = False


def _without_gc_pauses(fn: _F) -> _F:
    """Runs ``fn`` with Python's cyclic garbage collector paused (reference counting still frees
    memory), restored when the last concurrent load ends.

    A load creates thousands of objects that all survive (modules, parameters, plan records),
    which is what makes the collector run: a full collection walks every object of the process,
    and with torch and a large model library imported one took 265-295 ms in the middle of a
    0.3 s load of 4 GiB here (measured with ``gc.callbacks``). Cycles made meanwhile are
    collected afterwards.
    """

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        global _gc_paused, _gc_was_enabled
        with _gc_lock:
            if _gc_paused == 0:
                _gc_was_enabled = gc.isenabled()
                gc.disable()
            _gc_paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _gc_lock:
                _gc_paused -= 1
                if _gc_paused == 0 and _gc_was_enabled:
                    gc.enable()

    return paused  # type: ignore[return-value]


def _device_explicit(fn: _F) -> _F:
    """Runs ``fn`` with torch's factory functions allocating on the CPU unless told otherwise.

    The load's devices are its arguments (``device``, ``device_map``): an ambient device context
    of the caller (``with torch.device("meta")``, ``torch.set_default_device("cuda")``) must not
    leak into the skeleton's buffers, the family's finishing code or any temporary, as it would
    put tensors on a device nobody asked for (a meta buffer in a loaded model, a CPU mapping
    viewed as a meta tensor). fastload's own allocations name their device as well."""

    @functools.wraps(fn)
    def explicit(*args: Any, **kwargs: Any) -> Any:
        with cpu_by_default():
            return fn(*args, **kwargs)

    return explicit  # type: ignore[return-value]


@_device_explicit
@_without_gc_pauses
def load(
    target: Target,
    checkpoint: str | os.PathLike[str] | Mapping[str, torch.Tensor],
    options: LoadOptions,
    *,
    seconds: dict[str, float] | None = None,
) -> tuple[nn.Module, LoadReport]:
    """Loads ``checkpoint`` (a local path, or a state dict) into ``target`` with ``options``
    (:class:`~fastload.core.load_options.LoadOptions`, validated by the entry). ``seconds`` are
    phases already spent by the caller (resolving a model id), put first in the report."""
    clock = _Clock()
    clock.seconds.update(seconds or {})
    want = options.dtype

    with clock.phase("resolve"):
        ckpt = open_source(
            checkpoint,
            options.read_mode,
            options.mmap,
            options.allow_pickle,
            options.storage_options,
        )
        group = None
        if options.collective and any(is_remote(f) for f in ckpt.files):
            raise UnsupportedError(
                f"{ckpt.location.files[0]}: a collective load (process_group, tp_plan) reads "
                "local files; load a checkpoint in object storage without them"
            )
        if options.collective:
            where = "tp_plan" if options.tp_plan is not None else "process_group"
            group = RankGroup(options.process_group, where=where)
            check_same_checkpoint(group, ckpt)
        built_here = target.module is None
        if want == "auto":
            # the model family's rule for a model built for this load (its hooks' auto_dtype);
            # the stored dtypes for any other model, and for a module passed in
            hooks_first = target.hooks if built_here else None
            want = hooks_first.auto_dtype(ckpt) if hooks_first is not None else None
        assert not isinstance(want, str)
        stored = _main_dtype(ckpt)
        # the disk starts on the files now, and their pages are mapped, while the skeleton is
        # built and the load planned; only where the tensors will be views of the mappings
        views = options.views_possible and want in (None, stored) and options.read_ahead
        # what this process may still make resident (its cgroup's limit): read-ahead stays within
        # it, and a load that must own more is refused before it allocates (fastload.core.memory)
        budget = memory_budget()
        warm_up = WarmUp(ckpt.files, options.mmap, views=views, budget=budget)
    location = ckpt.location
    source = str(location.index or location.files[0])

    with clock.phase("skeleton"):
        if target.module is not None:
            module = target.module
        else:
            assert target.build is not None
            module = target.build(stored if want is None else want)
    hooks = target.hooks or target.choose_hooks(module)
    shards = None
    if built_here:
        hooks.prepare(module)
        shards = hooks.shard(module)  # the family's own destinations (its own TP parameters)
    was_training = module.training

    with clock.phase("plan"):
        dmap = _device_map(module, options)
        tp = None
        if options.tp_plan is not None and shards is None:
            tp = layout_for(options.tp_plan, module, options.process_group)
        placement = Placement(
            device=options.device,
            dtype=want,
            keep_fp32=hooks.keep_fp32(module, want),
            skeleton_dtypes=built_here,
            device_map=dmap,
            tp=tp,
            provided=shards.tensors if shards is not None else None,
        )
        later = shards.later if shards is not None else set()
        load_plan = plan(module, ckpt, placement, options, source=source, hooks=hooks, later=later)
        report = load_plan.report
        check_owned_memory(load_plan, options.mmap, options.staging, budget)

    with clock.phase("allocate"):
        by_file = allocate(
            load_plan,
            ckpt,
            warm_up.mappings,
            threads=options.threads,
            budget=budget,
            paced=options.read_ahead,
        )

    with clock.phase("read"):
        pool = options.staging
        if group is not None and group.world_size > 1:
            _read_collectively(group, ckpt, by_file, report, threads=options.threads)
        else:
            report.bytes_written = _read(
                ckpt, by_file, threads=options.threads, progress=options.progress, pool=pool
            )
        report.staging_bytes = pool.peak_bytes
        resolve_duplicates(load_plan.groups)

    with clock.phase("finish"):
        groups = load_plan.groups
        swap_in(
            module,
            groups,
            report,
            offloaded=offloaded_names(groups) | later,
            family=hooks.initialize,
            dropped=hooks.dropped_attributes(),
        )
        forget_constructor_values(module)
        if dmap is not None and dmap.has_disk:
            dispatch_offloaded(module, dmap, groups, ckpt)
        elif dmap is not None:
            dispatch(module, dmap)
        if tp is not None:
            _finish_tensor_parallel(module, tp, options.process_group, report)
        # a local checkpoint's directory (not a state dict's label, nor a prefix in object
        # storage: the entry that resolved one gives the family its own directory, if any)
        local = isinstance(location.directory, Path) and not isinstance(
            ckpt.files[0], StateDictFile
        )
        directory = location.directory if local else None
        hooks.finish(
            module, directory=directory, built_here=built_here, device_map=dmap, report=report
        )
        if options.gradient_checkpointing:
            gradient_checkpointing_enable(module)
            module.train()
        else:
            # A model fastload built is ready for inference; a module passed in keeps its mode.
            module.train(was_training and not built_here)
        # Last: nothing above reads a view's bytes, so the pages were read and mapped beside it
        warm_up.join()
        report.bytes_read_ahead += warm_up.mapped
        if warm_up.mappings:
            report.read_ahead = "the whole files, beside the skeleton build (they fit the budget)"
        report.memory_budget, report.memory_source = budget.available, budget.source

    report.seconds = dict(clock.seconds)
    # Each file's way of reading: read_mode, or "torch.load(weights_only)" for a pickle file.
    modes = "+".join(dict.fromkeys(f.mode for f in ckpt.files))
    report.read_mode = f"{modes}+shared-mmap" if report.bytes_shared else modes
    report.files = [str(f) for f in location.files]
    report.device = (
        str(options.device)
        if dmap is None
        else ", ".join(dict.fromkeys(dmap.as_strings().values()))
    )
    report.device_map = None if dmap is None else dmap.as_strings()
    report.dtype = "stored" if want is None else str(want).removeprefix("torch.")
    report.model_class = type(module).__name__
    logger.info("%s", report.summary())
    return module, report


def _device_map(module: nn.Module, options: LoadOptions) -> DeviceMap | None:
    """The load's device map resolved against ``module`` (``None`` without one)."""
    if options.device_map is None:
        return None
    disk = options.offload_folder is not None
    if disk:
        require_accelerate()
        try:
            os.makedirs(options.offload_folder, exist_ok=True)  # type: ignore[arg-type]
        except OSError as e:  # the same built-in class, naming the argument
            raise from_os_error(
                e,
                options.offload_folder,  # type: ignore[arg-type]
                "offload_folder: cannot create the directory",
            ) from e
    return resolve_device_map(
        options.device_map,
        module,
        max_memory=options.max_memory,
        no_split=options.no_split_module_classes,
        disk=disk,
    )


def _finish_tensor_parallel(
    module: nn.Module, tp: TPLayout, process_group: Any, report: LoadReport
) -> None:
    parallelize(module, tp, process_group)
    unused = tp.unused_patterns(s.name for s in tensor_slots(module))
    if unused:
        logger.warning("tp_plan: patterns %s match no parameter of the model", unused)
    report.rank, report.world_size = tp.rank, tp.world_size


def _main_dtype(ckpt: OpenCheckpoint) -> torch.dtype | None:
    """The checkpoint's floating dtype holding the most bytes (``None``: none is floating), which
    the skeleton is built under unless a dtype is asked for."""
    totals: dict[str, int] = {}
    for t in ckpt.tensors.values():
        if t.st_dtype in CONVERTIBLE:
            totals[t.st_dtype] = totals.get(t.st_dtype, 0) + t.nbytes
    if not totals:
        return None
    return parse_dtype(max(totals, key=lambda k: totals[k]))


def _read_collectively(
    group: RankGroup,
    ckpt: OpenCheckpoint,
    by_file: dict[int, list[Fill]],
    report: LoadReport,
    *,
    threads: int | None,
) -> None:
    """The read of a collective load: this rank reads its part of the bytes from storage and
    receives the rest from the group (:mod:`fastload.distributed.collective`); the report counts
    each."""
    fills = [(f.name, f.tensor, f.selection) for index in sorted(by_file) for f in by_file[index]]
    exchange = read_collectively(group, ckpt, fills, threads=threads)
    report.bytes_written = sum(t.numel() * t.element_size() for _, t, _ in fills)
    report.bytes_read = exchange.storage_bytes
    report.bytes_received = exchange.received_bytes
    report.rank, report.world_size = group.rank, group.world_size


def _read(
    ckpt: OpenCheckpoint,
    by_file: dict[int, list[Fill]],
    *,
    threads: int | None,
    progress: bool,
    pool: StagingPool,
) -> int:
    """One copy call per file (all its tensors at once, so the engine parallelises across them),
    or one for every file of a checkpoint in object storage (the shards read in parallel with
    each other); the progress bar advances per copied piece (:mod:`fastload.core.progress`);
    accelerator destinations of every file share ``pool``, released at the end."""
    total = sum(f.tensor.numel() * f.tensor.element_size() for fs in by_file.values() for f in fs)
    work = [(ckpt.files[index], by_file[index]) for index in sorted(by_file)]
    with byte_progress(total, progress) as counter:
        try:
            if any(is_remote(file) for file, _ in work):
                # one copy for every file: the shards' requests in parallel with each other
                return reader.fill_many(work, threads, pool, counter)
            return sum(reader.fill(file, fills, threads, pool, counter) for file, fills in work)
        finally:
            pool.release()
