"""The core load pipeline: a checkpoint into any ``nn.Module``, read top to bottom in :func:`load`.

The load runs in phases, each timed in the :class:`~fastload.report.LoadReport`:

1. **resolve** the checkpoint (one file, a directory, a sharded index, or an in-memory state
   dict) and read every header (:mod:`fastload.checkpoint`);
2. build the **skeleton**: parameters on ``meta``, buffers real (:mod:`fastload.skeleton`);
3. **plan**: map checkpoint names onto model names and apply the key policies
   (:mod:`fastload.planning`); decide each tensor's destination (:mod:`fastload.placement`);
4. **allocate** every destination once, on its final device and dtype;
5. **read**: one Rust copy per file (:func:`fastload.engine.copy_into`) fills all of that file's
   destinations in parallel;
6. **finish**: swap the new tensors into the model and initialize what the checkpoint lacks
   (:mod:`fastload.finishing`), then dispatch, tensor-parallel wrapping, the model family's own
   finishing (:mod:`fastload.hooks`), and the train/eval mode.

Nothing in the model changes before every copy has succeeded, and a failure while swapping or
initializing puts the original tensors back, so a module passed in is never left half-loaded by a
bad checkpoint. The steps after that are not rolled back if they fail.

This module knows torch modules only. :func:`fastload.from_pretrained` (:mod:`fastload.api`) is
the public entry: it sends Hugging Face model ids, transformers classes and options through
:mod:`fastload.hf`, which resolves them and then calls :func:`load`.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from fastload import keys as keymod
from fastload import reader
from fastload.checkpoint import (
    OpenCheckpoint,
)
from fastload.device_map import DISK, DeviceMapArg, dispatch, resolve_device_map
from fastload.devices import cpu_by_default, parse_device
from fastload.dtypes import CONVERTIBLE, parse_dtype, to_st
from fastload.errors import RequestError, UnsupportedError, from_os_error
from fastload.finishing import resolve_duplicates, swap_in
from fastload.hooks import ModelHooks, hooks_for
from fastload.memory import MemoryBudget, check_owned_memory, memory_budget
from fastload.offload import dispatch_offloaded, offloaded_names, require_accelerate
from fastload.pickle_file import StateDictFile
from fastload.placement import Destination, Placement, Selection, selected_shape
from fastload.planning import Group, plan, source_bytes
from fastload.progress import byte_progress
from fastload.report import LoadReport
from fastload.sharing import (
    SharedMapping,
    WarmUp,
    check_mmap_mode,
    file_sharing,
    prefetch_in_order,
)
from fastload.skeleton import build_skeleton, forget_constructor_values
from fastload.source import open_source
from fastload.streaming import StagingPool
from fastload.tensor_parallel import TPLayout, layout_for, parallelize
from fastload.threads import check_threads
from fastload.tying import tensor_slots

logger = logging.getLogger("fastload")

__all__ = ["Destination", "Placement", "Target", "load", "plain_target", "selected_shape"]


@dataclass
class Target:
    """What a load fills: an already-built ``module`` (loaded in place, its train/eval mode kept)
    or a ``build`` function that makes the skeleton under a dtype (the model is then fastload's
    and ends in eval mode)."""

    module: nn.Module | None = None
    build: Callable[[torch.dtype | None], nn.Module] | None = None
    #: the model family's hooks (default: chosen by :func:`fastload.hooks.hooks_for`)
    hooks: ModelHooks | None = None


def plain_target(model: Any, config: Any, model_kwargs: dict[str, Any]) -> Target:
    """The target for an ``nn.Module`` passed in, or any module class or factory (called with
    ``**model_kwargs``, or ``(config, **model_kwargs)`` when ``config`` is given)."""
    if isinstance(model, nn.Module):
        if config is not None or model_kwargs:
            raise RequestError(
                "config and model keyword arguments only apply when fastload builds the model; "
                f"got an already-built {type(model).__name__} (and {sorted(model_kwargs)})"
            )
        return Target(module=model)
    if not callable(model):
        raise RequestError(
            "model must be an nn.Module class, a factory, a built module, a model id or "
            f"directory, or None; got {model!r}"
        )
    args = () if config is None else (config,)

    def build(dtype: torch.dtype | None) -> nn.Module:
        return build_skeleton(lambda: model(*args, **model_kwargs), dtype=dtype)

    return Target(build=build)


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
    and with torch and transformers imported one took 265-295 ms in the middle of a 0.3 s load of
    4 GiB here (measured with ``gc.callbacks``). Cycles made meanwhile are collected afterwards.
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
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    strict: bool = False,
    missing: str = "warn",
    unexpected: str = "warn",
    ignore_mismatched_sizes: bool = False,
    key_map: keymod.KeyMap | None = None,
    progress: bool = True,
    gradient_checkpointing: bool = False,
    read_mode: str = "pread",
    mmap: str = "auto",
    threads: int | None = None,
    device_map: DeviceMapArg | None = None,
    max_memory: dict[Any, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    tp_plan: str | dict[str, str] | None = None,
    process_group: Any = None,
    allow_pickle: bool = False,
    staging_bytes: int | str | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    read_ahead: bool = True,
    seconds: dict[str, float] | None = None,
) -> tuple[nn.Module, LoadReport]:
    """Loads ``checkpoint`` (a local path, or a state dict) into ``target``; the options are
    :func:`fastload.from_pretrained`'s. ``read_ahead=False`` starts no read-ahead thread
    (:class:`~fastload.sharing.WarmUp`, :class:`~fastload.paced.PacedReadAhead`): with
    ``threads=1`` the whole load runs on the calling thread. ``seconds`` are phases already spent
    by the caller (resolving a model id), put first in the report."""
    clock = _Clock()
    clock.seconds.update(seconds or {})
    missing_policy, unexpected_policy = keymod.resolve_policies(strict, missing, unexpected)
    target_device = parse_device(device, where="from_pretrained", allow_meta=True)
    want = _requested_dtype(dtype)
    if max_memory is not None and device_map is None:
        device_map = "auto"  # budgets alone ask for a planned placement, as with accelerate
    check_mmap_mode(mmap)
    check_threads(threads)  # here, not only where copies start: a load of views copies nothing
    _check_parallel_options(target_device, device_map, max_memory, tp_plan, process_group)
    if target_device.type == "meta":
        raise RequestError("from_pretrained: device 'meta' holds no data to load into")
    pool = StagingPool.sized(staging_bytes)  # validated now; buffers allocated on first use

    with clock.phase("resolve"):
        ckpt = open_source(checkpoint, read_mode, mmap, allow_pickle)
        built_here = target.module is None
        if want == "auto":
            # transformers' rule for a model its layer builds (fastload.hf.dtype_rules); the
            # stored dtypes for any other model, and for a module passed in
            hooks_first = target.hooks if built_here else None
            want = hooks_first.auto_dtype(ckpt) if hooks_first is not None else None
        stored = _main_dtype(ckpt)
        # the disk starts on the files now, and their pages are mapped, while the skeleton is
        # built and the load planned; only where the tensors will be views of the mappings
        views = target_device.type == "cpu" and device_map is None and tp_plan is None
        views = views and want in (None, stored) and read_ahead
        # what this process may still make resident (its cgroup's limit): read-ahead stays within
        # it, and a load that must own more is refused before it allocates (fastload.memory)
        budget = memory_budget()
        warm_up = WarmUp(ckpt.files, mmap, views=views, budget=budget)
    location = ckpt.location
    source = str(location.index or location.files[0])

    with clock.phase("skeleton"):
        if target.module is not None:
            module = target.module
        else:
            assert target.build is not None
            module = target.build(stored if want is None else want)
    hooks = target.hooks or hooks_for(module)
    was_training = module.training

    with clock.phase("plan"):
        dmap = None
        if device_map is not None:
            disk = offload_folder is not None
            if disk:
                require_accelerate()
                try:
                    os.makedirs(offload_folder, exist_ok=True)  # type: ignore[arg-type]
                except OSError as e:  # the same built-in class, naming the argument
                    raise from_os_error(
                        e,
                        offload_folder,
                        "offload_folder: cannot create the directory",  # type: ignore[arg-type]
                    ) from e
            dmap = resolve_device_map(
                device_map,
                module,
                max_memory=max_memory,
                no_split=no_split_module_classes,
                disk=disk,
            )
        tp = layout_for(tp_plan, module, process_group) if tp_plan is not None else None
        placement = Placement(
            device=target_device,
            dtype=want,
            keep_fp32=hooks.keep_fp32(module, want),
            skeleton_dtypes=built_here,
            device_map=dmap,
            tp=tp,
        )
        groups, report = plan(
            module,
            ckpt,
            placement,
            key_map=keymod.compile_key_map(key_map),
            missing_policy=missing_policy,
            unexpected_policy=unexpected_policy,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            source=source,
            hooks=hooks,
        )
        check_owned_memory(groups, ckpt.files, mmap, pool, budget)

    with clock.phase("allocate"):
        by_file = _allocate(
            groups,
            placement,
            ckpt,
            report,
            mmap,
            warm_up.mappings,
            threads=threads,
            budget=budget,
            paced=read_ahead,
        )

    with clock.phase("read"):
        report.bytes_written = _read(ckpt, by_file, threads=threads, progress=progress, pool=pool)
        report.staging_bytes = pool.peak_bytes
        resolve_duplicates(groups)

    with clock.phase("finish"):
        swap_in(module, groups, report, offloaded=offloaded_names(groups))
        forget_constructor_values(module)
        if dmap is not None and dmap.has_disk:
            dispatch_offloaded(module, dmap, groups, ckpt)
        elif dmap is not None:
            dispatch(module, dmap)
        if tp is not None:
            _finish_tensor_parallel(module, tp, process_group, report)
        directory = None if isinstance(ckpt.files[0], StateDictFile) else location.directory
        hooks.finish(
            module, directory=directory, built_here=built_here, device_map=dmap, report=report
        )
        if gradient_checkpointing:
            from fastload.checkpointing import gradient_checkpointing_enable

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
        str(target_device) if dmap is None else ", ".join(dict.fromkeys(dmap.as_strings().values()))
    )
    report.device_map = None if dmap is None else dmap.as_strings()
    report.dtype = "stored" if want is None else str(want).removeprefix("torch.")
    report.model_class = type(module).__name__
    logger.info("%s", report.summary())
    return module, report


def _check_parallel_options(
    device: torch.device,
    device_map: Any,
    max_memory: Any,
    tp_plan: Any,
    process_group: Any,
) -> None:
    if device_map is not None and device != torch.device("cpu"):
        raise RequestError(f"pass either device ({device}) or device_map, not both")
    if device_map is not None and tp_plan is not None:
        raise UnsupportedError(
            "device_map and tp_plan cannot be combined; use device= with tp_plan"
        )
    if max_memory is not None and device_map is None:
        raise RequestError("max_memory only applies with device_map='auto'")
    if process_group is not None and tp_plan is None:
        raise RequestError("process_group only applies with tp_plan")


def _finish_tensor_parallel(
    module: nn.Module, tp: TPLayout, process_group: Any, report: LoadReport
) -> None:
    parallelize(module, tp, process_group)
    unused = tp.unused_patterns(s.name for s in tensor_slots(module))
    if unused:
        logger.warning("tp_plan: patterns %s match no parameter of the model", unused)
    report.rank, report.world_size = tp.rank, tp.world_size


def _requested_dtype(dtype: str | torch.dtype) -> torch.dtype | str | None:
    """The requested dtype, ``"auto"`` (decided with the model's hooks) or ``None``
    (``"stored"``: each tensor's stored dtype)."""
    if isinstance(dtype, str) and dtype in ("auto", "stored"):
        return None if dtype == "stored" else "auto"
    want = parse_dtype(dtype)
    if to_st(want) not in CONVERTIBLE:
        raise RequestError(
            "dtype must be 'auto', 'stored' or a floating-point type "
            f"(float32/float16/bfloat16/float64), got {want}"
        )
    return want


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


def _allocate(
    groups: list[Group],
    placement: Placement,
    shared: OpenCheckpoint | None = None,
    report: LoadReport | None = None,
    mmap: str = "shared",
    premapped: Mapping[int, SharedMapping] | None = None,
    *,
    threads: int | None = None,
    budget: MemoryBudget | None = None,
    paced: bool = True,
) -> dict[int, list[tuple[str, torch.Tensor, Selection, int]]]:
    """Allocates every new tensor once; returns the fill items per file index
    (tensor name, destination, selection, source bytes).

    With ``shared``, a whole CPU tensor stored in its wanted dtype in a file that ``mmap`` lets
    be mapped (:func:`~fastload.sharing.file_sharing`) is a view of a copy-on-write mapping of its
    file instead, and needs no copy. ``premapped``: mappings the warm-up already reads ahead
    (:class:`~fastload.sharing.WarmUp`); the views of any other mapping are read ahead here, as
    far as ``budget`` allows (:func:`~fastload.sharing.prefetch_in_order`; ``paced``: it may
    start its helper thread)."""
    premapped = premapped or {}
    mappings: dict[int, SharedMapping] = dict(premapped)
    sharing = {i: file_sharing(f, mmap) for i, f in enumerate(shared.files)} if shared else {}
    viewed: set[str] = set()  # an untied alias of a stored tensor gets a copy, not a second view
    by_file: dict[int, list[tuple[str, torch.Tensor, Selection, int]]] = {}
    for group in groups:
        first = group.slots[0]
        if group.action == "load" and group.pieces is not None:
            # Merged (MoE experts) or split (fused qkv) tensors: each stored piece is read
            # straight into its slice of the one destination (fastload.hf.conversions).
            dest = group.sources[0][2]
            if dest.device == DISK:
                raise UnsupportedError(
                    f"{group.pieces[0].stored.name!r} is merged into or split from "
                    f"{first.name!r}, which the device map offloads to disk; fastload reads "
                    "offloaded tensors by their stored name only: map that module to a device"
                )
            tensor = torch.empty(tuple(group.template.shape), dtype=dest.dtype, device=dest.device)
            for piece in group.pieces:
                by_file.setdefault(piece.stored.file, []).append(
                    (piece.stored.name, piece.view(tensor), piece.selection, piece.nbytes)
                )
            group.dest, group.new = dest, tensor
            continue
        if group.action == "load":
            for i, (slot, stored, dest) in enumerate(group.sources):
                tensor = None
                if (
                    shared is not None
                    and dest.device.type == "cpu"
                    and dest.selection is None
                    and stored.name not in viewed
                    and sharing[stored.file][0]
                ):
                    viewed.add(stored.name)
                    if stored.file not in mappings:
                        mappings[stored.file] = SharedMapping(shared.files[stored.file])
                    tensor = mappings[stored.file].view(stored.name, dest.dtype)
                if dest.device == DISK:  # stays in the file; read when its module runs
                    if report is not None:
                        report.bytes_read -= source_bytes(stored, dest)
                        report.bytes_offloaded += source_bytes(stored, dest)
                        report.tensors_loaded -= 1
                    if i == 0:
                        group.dest = dest
                    continue
                if tensor is None:
                    shape = selected_shape(stored.shape, dest.selection)
                    tensor = torch.empty(shape, dtype=dest.dtype, device=dest.device)
                    by_file.setdefault(stored.file, []).append(
                        (stored.name, tensor, dest.selection, source_bytes(stored, dest))
                    )
                elif report is not None:
                    report.bytes_shared += tensor.numel() * tensor.element_size()
                if i == 0:
                    group.dest, group.new = dest, tensor
                else:
                    group.extra.append((slot, tensor))
            continue
        dest = placement.destination(first.name, group.template, None, is_buffer=first.is_buffer)
        if dest.device == DISK:  # not in the file: kept in memory, served to the offload hooks
            dest = Destination(torch.device("cpu"), dest.dtype, dest.selection)
        group.dest = dest
        shape = selected_shape(tuple(group.template.shape), dest.selection)
        if group.action == "init":
            if dest.dtype.is_floating_point or dest.dtype.is_complex:
                # NaN marks "not initialized yet": skeleton.initialize checks none is left.
                group.new = torch.full(shape, math.nan, dtype=dest.dtype, device=dest.device)
            else:
                group.new = torch.zeros(shape, dtype=dest.dtype, device=dest.device)
            continue
        if group.template.device.type == "meta":
            continue  # caught by the final no-meta check with its name
        t = group.template
        if dest.selection is not None:  # a kept parameter of a module passed in: its shard
            dim, start, stop = dest.selection
            t = t.narrow(dim, start, stop - start)
        if t is not group.template or t.device != dest.device or t.dtype != dest.dtype:
            group.new = t.detach().to(device=dest.device, dtype=dest.dtype, copy=True)
    later = [m for i, m in mappings.items() if i not in premapped]
    if later:
        ahead, how = prefetch_in_order(later, budget or memory_budget(), threads, paced=paced)
        if report is not None:
            report.bytes_read_ahead, report.read_ahead = report.bytes_read_ahead + ahead, how
    if report is not None and shared is not None:
        report.sharing = {
            f.path: _sharing_line(why, mappings.get(i), len(by_file.get(i, ())))
            for i, (f, (_, why)) in enumerate(zip(shared.files, sharing.values(), strict=True))
        }
    return by_file


def _sharing_line(why: str, mapping: Any, copies: int) -> str:
    """How one file's tensors were loaded, for the report."""
    views = mapping.views if mapping is not None else 0
    if views and copies:
        return f"{views} views, {copies} copies (converted, sharded or misaligned); {why}"
    if views or why.startswith("copies"):
        return why
    return "copies (converted, sharded, misaligned or not on the CPU)"


def _read(
    ckpt: OpenCheckpoint,
    by_file: dict[int, list[tuple[str, torch.Tensor, Selection, int]]],
    *,
    threads: int | None,
    progress: bool,
    pool: StagingPool,
) -> int:
    """One copy call per file (all its tensors at once, so the engine parallelises across them);
    the progress bar advances per copied piece (:mod:`fastload.progress`); accelerator
    destinations of every file share ``pool``, released at the end."""
    total = sum(t.numel() * t.element_size() for items in by_file.values() for _, t, *_ in items)
    written = 0
    with byte_progress(total, progress) as counter:
        try:
            for index in sorted(by_file):
                items = by_file[index]
                jobs = [(n, t, s) for n, t, s, _ in items]
                written += reader.fill(ckpt.files[index], jobs, threads, pool, counter)
        finally:
            pool.release()
    return written
