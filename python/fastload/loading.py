"""``fastload.from_pretrained``: a model built on the meta device, filled from safetensors files.

The load runs in phases, each timed in the :class:`~fastload.report.LoadReport`:

1. **resolve** the checkpoint (one file, a directory, or a sharded index) and read every header;
2. build the **skeleton**: parameters on ``meta``, buffers real (:mod:`fastload.skeleton`);
3. **plan**: map checkpoint names onto model names and apply the key policies
   (:mod:`fastload.keys`); decide each tensor's :class:`Destination` (:class:`Placement`);
4. **allocate** every destination once, on its final device and dtype;
5. **read**: one Rust ``copy_into`` per file fills all of that file's destinations in parallel;
6. **finish**: swap the new tensors into the model (every member of a tie group gets the same
   Parameter), initialize what the checkpoint lacks, check nothing is left on ``meta``.

Nothing in the model changes before every copy has succeeded, and a failure while swapping or
initializing puts the original tensors back, so a module passed in is never left half-loaded by a
bad checkpoint. The steps after that (transformers' own finishing, device-map dispatch,
tensor-parallel wrapping, enabling gradient checkpointing) are not rolled back if they fail.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastload import keys as keymod
from fastload.checkpoint import OpenCheckpoint, StoredTensor, open_checkpoint, resolve
from fastload.device_map import DeviceMap, DeviceMapArg, dispatch, resolve_device_map
from fastload.dtypes import CONVERTIBLE, parse_dtype, to_st
from fastload.errors import CheckpointError, FastloadError, RequestError, UnsupportedError
from fastload.pickle_file import is_pickle
from fastload.report import LoadReport
from fastload.saving import TIED_KEY
from fastload.sharing import check_mmap_mode
from fastload.skeleton import build_skeleton, initialize, is_transformers_model, mark_initialized
from fastload.tensor_parallel import TPLayout, layout_for, parallelize
from fastload.tying import Slot, group_slots, tensor_slots

logger = logging.getLogger("fastload")

#: loads above this size show a progress bar even when stderr is not a terminal
PROGRESS_MIN_BYTES = 64 << 20

Selection = list[int] | None


# --------------------------------------------------------------------------------------------
# Where each tensor goes: the one place that decides it.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    """Where one model tensor is allocated, and which part of the stored tensor fills it.

    ``selection`` is what the copy engine takes: ``None`` (the whole tensor), ``[start, stop]``
    (flat elements) or ``[dim, start, stop]`` (a slice along ``dim``, e.g. a tensor-parallel shard).
    """

    device: torch.device
    dtype: torch.dtype
    selection: Selection = None


def selected_shape(shape: tuple[int, ...], selection: Selection) -> tuple[int, ...]:
    """The shape of the part of a ``shape``-d tensor that ``selection`` takes."""
    if selection is None:
        return tuple(shape)
    if len(selection) == 2:
        return (selection[1] - selection[0],)
    dim, start, stop = selection
    out = list(shape)
    out[dim] = stop - start
    return tuple(out)


class Placement:
    """Decides the :class:`Destination` of every model tensor.

    This is the single place where device, dtype and the selected part of a stored tensor are
    chosen; per-tensor placement (a device map), tensor-parallel slicing and zero-copy modes belong
    here. Rules:

    * device: ``device`` for every tensor, or with a ``device_map`` the device of the longest
      module prefix containing its name (:mod:`fastload.device_map`);
    * selection: with a tensor-parallel layout ``tp``, the rows or columns this rank owns of a
      parameter the plan shards, taken from the model's full shape
      (:mod:`fastload.tensor_parallel`);
    * dtype ``"auto"`` (``dtype=None`` here): the stored dtype for loaded tensors, the model's for
      the others;
    * an explicit floating ``dtype``: loaded floating tensors are converted to it during the copy,
      except where the model decides otherwise: names matching ``keep_fp32`` (transformers'
      ``_keep_in_fp32_modules``) become float32, and when fastload built the skeleton under that
      dtype (``skeleton_dtypes=True``) a float tensor the model created in another dtype keeps it
      (what transformers does). Tensors stored in a type the copy engine cannot convert (integers,
      float8...) keep the stored type; buffers that are not loaded keep theirs.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        keep_fp32: Any | None = None,
        skeleton_dtypes: bool = False,
        device_map: DeviceMap | None = None,
        tp: TPLayout | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.keep_fp32 = keep_fp32  # compiled regex (search) or None
        self.skeleton_dtypes = skeleton_dtypes
        self.device_map = device_map
        self.tp = tp

    def destination(
        self,
        name: str,
        template: torch.Tensor,
        stored: StoredTensor | None,
        *,
        is_buffer: bool,
    ) -> Destination:
        """The destination of model tensor ``name`` (``template`` is the tensor the model holds
        now, possibly on meta; ``stored`` is the checkpoint tensor that fills it, if any)."""
        device = self.device if self.device_map is None else self.device_map.device_of(name)
        selection = None
        if self.tp is not None and not is_buffer:
            selection = self.tp.selection(name, tuple(template.shape))
        return Destination(device, self._dtype(name, template, stored, is_buffer), selection)

    def _dtype(
        self, name: str, template: torch.Tensor, stored: StoredTensor | None, is_buffer: bool
    ) -> torch.dtype:
        if stored is not None and stored.st_dtype not in CONVERTIBLE:
            return stored.dtype
        base = stored.dtype if stored is not None else template.dtype
        if self.dtype is None or not base.is_floating_point:
            return base
        if self.keep_fp32 is not None and self.keep_fp32.search(name) is not None:
            return torch.float32
        if stored is None and (is_buffer or self.skeleton_dtypes):
            return template.dtype
        if self.skeleton_dtypes and to_st(template.dtype) in CONVERTIBLE:
            return template.dtype
        return self.dtype


# --------------------------------------------------------------------------------------------
# The load plan.
# --------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """All slots holding one tensor (a tie group has several) and what happens to it."""

    slots: list[Slot]
    template: torch.Tensor
    # loaded members (slot, stored tensor, destination), canonical first
    sources: list[tuple[Slot, StoredTensor, Destination]] = field(default_factory=list)
    action: str = "keep"  # "load" | "init" | "keep"
    dest: Destination | None = None
    new: torch.Tensor | None = None
    # further members also present in the checkpoint, loaded to compare with the canonical one
    extra: list[tuple[Slot, torch.Tensor]] = field(default_factory=list)
    untied: list[Slot] = field(default_factory=list)

    @property
    def is_buffer(self) -> bool:
        return self.slots[0].is_buffer

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def keyed(self) -> list[str]:
        """Names that belong in a state dict (parameters and persistent buffers)."""
        return [s.name for s in self.slots if not s.is_buffer or s.persistent]


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


class _Swap:
    """Replaces tensors in module slots, and can put every original back."""

    def __init__(self) -> None:
        self._undo: list[tuple[dict[str, Any], str, Any]] = []

    def set(self, slot: Slot, value: torch.Tensor) -> None:
        store = slot.module._buffers if slot.is_buffer else slot.module._parameters
        self._undo.append((store, slot.attr, store[slot.attr]))
        store[slot.attr] = value

    def rollback(self) -> None:
        for store, attr, old in reversed(self._undo):
            store[attr] = old
        self._undo.clear()


# --------------------------------------------------------------------------------------------
# from_pretrained
# --------------------------------------------------------------------------------------------


def from_pretrained(
    model: type[nn.Module] | Callable[..., nn.Module] | nn.Module | None,
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    strict: bool = False,
    missing: str = "init",
    unexpected: str = "warn",
    ignore_mismatched_sizes: bool = False,
    key_map: keymod.KeyMap | None = None,
    output_loading_info: bool = False,
    progress: bool = True,
    gradient_checkpointing: bool = False,
    read_mode: str = "pread",
    mmap: str = "auto",
    threads: int | None = None,
    config: Any = None,
    device_map: DeviceMapArg | None = None,
    max_memory: dict[Any, int | str] | None = None,
    tp_plan: str | dict[str, str] | None = None,
    process_group: Any = None,
    allow_pickle: bool = False,
    **model_kwargs: Any,
) -> nn.Module | tuple[nn.Module, LoadReport]:
    """Builds (or takes) a model and loads a safetensors checkpoint into it.

    Args:
        model: a transformers ``PreTrainedModel`` subclass (built from ``config`` or the
            ``config.json`` next to the weights), any ``nn.Module`` class or factory (called with
            ``**model_kwargs``, or ``(config, **model_kwargs)`` when ``config`` is given), an
            already-built module (loaded in place; left unchanged if loading fails), or ``None`` to
            use the transformers class named by ``config.json``'s ``architectures``.
        path: a ``.safetensors`` file, a directory with ``model.safetensors``, or a sharded
            checkpoint (its directory or its ``model.safetensors.index.json``); with
            ``allow_pickle``, also a pickle checkpoint (see ``allow_pickle``).
        device: where every tensor is allocated.
        dtype: ``"auto"`` keeps each tensor's stored dtype; a floating dtype converts floating
            tensors during the copy (see :class:`Placement`).
        strict: makes both ``missing`` and ``unexpected`` ``"error"``.
        missing: model tensors absent from the checkpoint: ``"error"``, ``"warn"`` (log, then
            initialize) or ``"init"`` (initialize silently). Initialization is the model's own
            (``_init_weights`` for transformers models, ``reset_parameters()`` otherwise); a tensor
            nothing initializes is a ``CheckpointError``. A module passed in keeps the values of
            parameters it already has.
        unexpected: checkpoint tensors the model has no place for: ``"error"``, ``"warn"``,
            ``"ignore"``. Names the model declares as expected are never reported.
        ignore_mismatched_sizes: re-initialize tensors whose stored shape differs, instead of
            raising ``CheckpointError``.
        key_map: renames checkpoint names first: a callable, or ``{regex: replacement}``.
        output_loading_info: also return the :class:`~fastload.report.LoadReport`.
        progress: show a progress bar over bytes for large loads or on a terminal.
        gradient_checkpointing: enable gradient checkpointing after loading and leave the model in
            train mode (otherwise it is in eval mode).
        read_mode: ``"pread"`` (default, no page faults) or ``"mmap"``.
        mmap: ``"auto"`` (default): on a local filesystem, CPU tensors whose stored dtype is the
            wanted one become views of a copy-on-write mapping of the file (no copy; processes
            loading the same checkpoint share one physical copy through the page cache); on
            network and FUSE filesystems, and for pickle files, every tensor is a private copy.
            ``"shared"``: views on any filesystem (safetensors files only: with a pickle
            checkpoint it is a ``RequestError``). ``"copy"``: every tensor is a private copy.
            Tensors that are converted, go to an accelerator or are sharded are always copies.
            The report's ``sharing`` says which way each file went; see :mod:`fastload.sharing`
            for the rule and the SIGBUS hazard of files changed in place.
        threads: copy threads (default: the engine's choice).
        config: a transformers config (or a path to one) to build the model from.
        device_map: instead of ``device``: ``"auto"`` (the GPUs, most free memory first, then the
            CPU; transformer blocks kept whole), a device, or ``{module prefix: device}``. Each
            tensor is allocated on its device and read there directly; tied parameters share one
            tensor, on the device of the name the checkpoint stores. When several devices are
            used, each mapped module moves its inputs to its weights' device before it runs. See
            :mod:`fastload.device_map`.
        max_memory: ``{device: bytes or "10GiB"}`` budgets for ``device_map="auto"``.
        tp_plan: tensor-parallel loading over ``torch.distributed``: ``{name pattern: style}``
            with styles ``"colwise"``, ``"rowwise"``, ``"replicate"``; ``"llama"``
            (:data:`~fastload.tensor_parallel.LLAMA_TP_PLAN`); or ``"auto"`` (the config's
            ``base_model_tp_plan``). Each rank reads only its rows or columns of the sharded
            weights; row-parallel ``nn.Linear`` layers all-reduce their output. The report's
            ``bytes_read`` is this rank's. See :mod:`fastload.tensor_parallel`.
        process_group: the group to shard over with ``tp_plan`` (default: the world group).
        allow_pickle: also load pickle checkpoints: a ``.bin``/``.pt`` file, a directory with
            ``pytorch_model.bin``, or a sharded ``pytorch_model.bin.index.json`` (checked like the
            safetensors index). They are read only with ``torch.load(weights_only=True)``, which
            refuses a pickle naming anything but tensors and plain containers (code that would
            run) with a ``CheckpointError``; every entry must be a tensor. The tensors then load
            exactly as a safetensors file's; ``read_mode`` does not apply and the report says
            ``"torch.load(weights_only)"``. Without it such checkpoints raise
            ``PickleRefusedError``. Safetensors files next to a pickle are always preferred.
        **model_kwargs: config overrides and ``__init__`` arguments, as in transformers.

    Returns:
        The model, or ``(model, report)`` with ``output_loading_info=True``.
    """
    clock = _Clock()
    missing_policy, unexpected_policy = keymod.resolve_policies(strict, missing, unexpected)
    target_device = torch.device(device)
    want = _requested_dtype(dtype)
    check_mmap_mode(mmap)
    _check_parallel_options(target_device, device_map, max_memory, tp_plan, process_group)

    with clock.phase("resolve"):
        location = resolve(path, allow_pickle=allow_pickle)
        if mmap == "shared" and any(is_pickle(f) for f in location.files):
            # Sharing views safetensors data at its file offsets; a pickle has no such layout.
            raise RequestError(
                f"{location.index or location.files[0]}: mmap='shared' needs safetensors files; "
                "load this pickle checkpoint with mmap='copy', or convert it once with "
                "`fastload convert`"
            )
        ckpt = open_checkpoint(location, read_mode)
    source = str(location.index or location.files[0])

    with clock.phase("skeleton"):
        module, built_here = _target(model, ckpt, want, config, model_kwargs, Path(path))
    hf = is_transformers_model(module)

    with clock.phase("plan"):
        dmap = None
        if device_map is not None:
            dmap = resolve_device_map(device_map, module, max_memory=max_memory)
        tp = layout_for(tp_plan, module, process_group) if tp_plan is not None else None
        placement = Placement(
            device=target_device,
            dtype=want,
            keep_fp32=_keep_fp32_pattern(module, want) if hf else None,
            skeleton_dtypes=built_here,
            device_map=dmap,
            tp=tp,
        )
        groups, report = _plan(
            module,
            ckpt,
            placement,
            key_map=keymod.compile_key_map(key_map),
            missing_policy=missing_policy,
            unexpected_policy=unexpected_policy,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            source=source,
        )

    with clock.phase("allocate"):
        by_file = _allocate(groups, placement, ckpt, report, mmap)

    with clock.phase("read"):
        report.bytes_written = _read(ckpt, by_file, threads=threads, progress=progress)
        _resolve_duplicates(groups)

    with clock.phase("finish"):
        _finish(module, groups, report)
        if dmap is not None:
            dispatch(module, dmap)
        if tp is not None:
            _finish_tensor_parallel(module, tp, process_group, report)
        if hf:
            _finish_transformers(module, location.directory, load_generation_config=built_here)
        if gradient_checkpointing:
            from fastload.checkpointing import gradient_checkpointing_enable

            gradient_checkpointing_enable(module)
            module.train()
        else:
            module.eval()

    report.seconds = dict(clock.seconds)
    # Each file's way of reading: read_mode, or "torch.load(weights_only)" for a pickle file.
    modes = "+".join(dict.fromkeys(f.mode for f in ckpt.files))
    report.read_mode = f"{modes}+shared-mmap" if report.bytes_shared else modes
    report.files = [str(f) for f in location.files]
    report.device = str(target_device) if dmap is None else ", ".join(map(str, dmap.devices))
    report.device_map = None if dmap is None else dmap.as_strings()
    report.dtype = "auto" if want is None else str(want).removeprefix("torch.")
    report.model_class = type(module).__name__
    logger.info("%s", report.summary())
    return (module, report) if output_loading_info else module


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


def _requested_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    if isinstance(dtype, str) and dtype == "auto":
        return None
    want = parse_dtype(dtype)
    if to_st(want) not in CONVERTIBLE:
        raise RequestError(
            f"dtype must be 'auto' or a floating-point type (float32/float16/bfloat16/float64), "
            f"got {want}"
        )
    return want


# --------------------------------------------------------------------------------------------
# Building the target model.
# --------------------------------------------------------------------------------------------


def _main_dtype(ckpt: OpenCheckpoint, want: torch.dtype | None) -> torch.dtype | None:
    """The dtype the skeleton is built under: the requested one, or the checkpoint's floating
    dtype holding the most bytes (``None``: torch's default)."""
    if want is not None:
        return want
    totals: dict[str, int] = {}
    for t in ckpt.tensors.values():
        if t.st_dtype in CONVERTIBLE:
            totals[t.st_dtype] = totals.get(t.st_dtype, 0) + t.nbytes
    if not totals:
        return None
    return parse_dtype(max(totals, key=lambda k: totals[k]))


def _target(
    model: Any,
    ckpt: OpenCheckpoint,
    want: torch.dtype | None,
    config: Any,
    model_kwargs: dict[str, Any],
    path: Path,
) -> tuple[nn.Module, bool]:
    """The module to load into, and whether fastload built it."""
    if isinstance(model, nn.Module):
        if config is not None or model_kwargs:
            raise RequestError(
                "config and model keyword arguments only apply when fastload builds the model; "
                f"got an already-built {type(model).__name__}"
            )
        return model, False
    directory = ckpt.location.directory
    if isinstance(model, (str, os.PathLike)):
        # A directory (or its config.json) naming the architecture, as in the design.
        arch_dir = Path(model)
        arch_dir = arch_dir.parent if arch_dir.name == "config.json" else arch_dir
        if config is None and arch_dir.resolve() != directory.resolve():
            config = str(arch_dir)
        model = _architecture_class(arch_dir)
    elif model is None:
        model = _architecture_class(directory)
    main = _main_dtype(ckpt, want)
    if is_transformers_model(model):
        cfg, init_kwargs = _transformers_config(model, directory, config, model_kwargs, path)
        if main is not None:
            # As transformers records it: the dtype the model was built in, sub-configs included.
            cfg.dtype = main
            for key in getattr(cfg, "sub_configs", None) or {}:
                sub = getattr(cfg, key, None)
                if sub is not None:
                    sub.dtype = main
        skeleton = build_skeleton(
            lambda: model(cfg, **init_kwargs), dtype=main, transformers_model=True
        )
        return skeleton, True
    if callable(model):
        if config is not None:
            return build_skeleton(lambda: model(config, **model_kwargs), dtype=main), True
        return build_skeleton(lambda: model(**model_kwargs), dtype=main), True
    raise RequestError(
        "model must be an nn.Module class, a factory, a built module, a directory with a "
        f"config.json, or None; got {model!r}"
    )


def _architecture_class(directory: Path) -> type[nn.Module]:
    config_path = directory / "config.json"
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
        name = data["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise CheckpointError(
            f"{config_path}: cannot tell the model class (no readable 'architectures' entry: {e}); "
            "pass the model class to from_pretrained"
        ) from e
    import transformers

    cls = getattr(transformers, name, None)
    if not isinstance(cls, type):
        raise UnsupportedError(f"{config_path}: transformers has no model class {name!r}")
    return cls


def _transformers_config(
    cls: type[nn.Module],
    directory: Path,
    config: Any,
    model_kwargs: dict[str, Any],
    path: Path,
) -> tuple[Any, dict[str, Any]]:
    """The config to build ``cls`` from, and the remaining ``__init__`` keyword arguments."""
    config_class = cls.config_class  # type: ignore[attr-defined]
    if config is None or isinstance(config, (str, os.PathLike)):
        where = Path(config) if config is not None else directory
        if config is None and not (directory / "config.json").is_file():
            raise CheckpointError(
                f"{directory}: no config.json to build {cls.__name__} from; pass config="
            )
        cfg, init_kwargs = config_class.from_pretrained(
            str(where), return_unused_kwargs=True, **model_kwargs
        )
    else:
        cfg, init_kwargs = copy.deepcopy(config), dict(model_kwargs)
    attn = init_kwargs.pop("attn_implementation", None)
    if attn is not None:
        cfg._attn_implementation = attn
    # A legacy config key; transformers would switch checkpointing on from it. fastload never
    # does: checkpointing is a run-time choice (gradient_checkpointing=True).
    if "gradient_checkpointing" in cfg.__dict__:
        if cfg.__dict__["gradient_checkpointing"]:
            logger.warning(
                "%s: the config's legacy 'gradient_checkpointing' key is ignored; pass "
                "gradient_checkpointing=True to enable it",
                directory / "config.json",
            )
        del cfg.__dict__["gradient_checkpointing"]
    cfg.name_or_path = str(path)
    return cfg, init_kwargs


def _keep_fp32_pattern(model: nn.Module, want: torch.dtype | None) -> Any | None:
    """transformers' ``_keep_in_fp32_modules`` (for float16) and ``..._strict`` (float16 and
    bfloat16) as one regex, searched in model names as transformers does."""
    patterns: list[str] = []
    if want == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if want in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return keymod.compile_patterns(p.replace("*", ".*") for p in patterns)


# --------------------------------------------------------------------------------------------
# Planning.
# --------------------------------------------------------------------------------------------


def _transformers_renames(model: nn.Module, source: str) -> list[keymod.Rename]:
    """The renamings transformers registers for this architecture (legacy ``LayerNorm.gamma``
    included); a checkpoint that needs one of its tensor-merging conversions is refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without registered conversions: nothing to apply
        return []

    transforms = get_model_conversion_mapping(model)
    renames: list[keymod.Rename] = [
        (lambda name, t=t: t.rename_source_key(name)[0])
        for t in transforms
        if isinstance(t, WeightRenaming)
    ]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if converters:

        def refuse(name: str) -> str:
            for c in converters:
                if c.rename_source_key(name)[1] is not None:
                    raise UnsupportedError(
                        f"{source}: tensor {name!r} needs transformers' conversion "
                        f"{c.source_patterns} -> {c.target_patterns}, which merges or splits "
                        "tensors; fastload only renames. Load it once with transformers and save "
                        "it with save_pretrained"
                    )
            return name

        renames.append(refuse)
    return renames


def _authorization(model: nn.Module, hf: bool, slots: list[Slot]) -> keymod.Authorization:
    unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if hf:
        # What transformers adds for buffers that used to be persistent (position_ids) or moved
        # (per-layer rotary inv_freq).
        buffers = [s.name for s in slots if s.is_buffer]
        if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
            unexpected.append(r"rotary_emb\.inv_freq")
        if any(b.endswith("position_ids") for b in buffers):
            unexpected.append(r"(^|\.)position_ids$")
    return keymod.Authorization(
        missing=keymod.compile_patterns(getattr(model, "_keys_to_ignore_on_load_missing", None)),
        unexpected=keymod.compile_patterns(unexpected),
    )


def _plan(
    model: nn.Module,
    ckpt: OpenCheckpoint,
    placement: Placement,
    *,
    key_map: keymod.Rename | None,
    missing_policy: str,
    unexpected_policy: str,
    ignore_mismatched_sizes: bool,
    source: str,
) -> tuple[list[_Group], LoadReport]:
    hf = is_transformers_model(model)
    slots = tensor_slots(model)
    groups = [_Group(slots=g, template=g[0].tensor) for g in group_slots(slots)]
    group_of = {s.name: g for g in groups for s in g.slots}
    slot_of = {s.name: s for s in slots}
    position = {s.name: i for g in groups for i, s in enumerate(g.slots)}
    model_keys = {n for g in groups for n in g.keyed()}
    computed = {s.name for s in slots if s.is_buffer and not s.persistent}
    prefix = getattr(model, "base_model_prefix", None) or None

    options: dict[str, Any] = {
        "base_model_prefix": prefix,
        "key_map": key_map,
        "renames": functools.partial(_transformers_renames, model, source) if hf else (),
        "source": source,
        "computed": computed,
    }
    mapping = keymod.map_keys(ckpt.tensors, model_keys, **options)
    report = LoadReport(renamed=mapping.renamed)
    pairs = list(mapping.to_model.items())
    pairs += _alias_pairs(ckpt, mapping, model_keys, group_of, options)

    # Sources, with shapes checked against the model before anything is allocated.
    wrong: list[str] = []
    for ckpt_name, model_name in pairs:
        stored = ckpt.tensors[ckpt_name]
        group, slot = group_of[model_name], slot_of[model_name]
        dest = placement.destination(model_name, group.template, stored, is_buffer=slot.is_buffer)
        # A selection (a tensor-parallel shard) is taken from the model's full shape: the stored
        # tensor must have that full shape.
        got, want = tuple(stored.shape), tuple(group.template.shape)
        if got != want:
            report.mismatched.append((model_name, got, want))
            wrong.append(
                f"{ckpt.file_path(stored)}: tensor {ckpt_name!r} has shape {list(got)}, the "
                f"model's {model_name!r} has shape {list(want)}"
            )
            continue
        _check_dtype(ckpt, stored, model_name, group.template)
        group.sources.append((slot, stored, dest))
    if wrong and not ignore_mismatched_sizes:
        shown = "\n  ".join(wrong[:20]) + (
            f"\n  ... ({len(wrong) - 20} more)" if len(wrong) > 20 else ""
        )
        raise CheckpointError(
            f"{len(wrong)} checkpoint tensors do not have the model's shape (pass "
            f"ignore_mismatched_sizes=True to re-initialize them instead):\n  {shown}"
        )
    mismatched = {m[0] for m in report.mismatched}

    # Unexpected checkpoint tensors.
    auth = _authorization(model, hf, slots)
    for ckpt_name, mapped in mapping.unmatched.items():
        ok = (
            mapped in computed
            or ckpt_name in computed
            or auth.unexpected_ok(model, ckpt_name, mapped, prefix)
        )
        (report.authorized_unexpected if ok else report.unexpected).append(ckpt_name)

    # What each group does, and missing model tensors.
    for group in groups:
        group.sources.sort(key=lambda s: position[s[0].name])
        if group.sources:
            group.action = "load"
            continue
        reinit = any(n in mismatched for n in group.names)
        if not reinit:  # a mismatched tensor is reported as such, not as missing
            for name in group.keyed():
                listed = report.authorized_missing if auth.missing_ok(name) else report.missing
                listed.append(name)
        if group.template.device.type == "meta" or (reinit and not group.is_buffer):
            group.action = "init"

    _apply_policies(report, missing_policy, unexpected_policy, source)
    report.tensors_loaded = sum(len(g.sources) for g in groups)
    report.bytes_read = sum(
        _source_bytes(stored, dest) for g in groups for _, stored, dest in g.sources
    )
    return groups, report


def _alias_pairs(
    ckpt: OpenCheckpoint,
    mapping: keymod.KeyMapping,
    model_keys: set[str],
    group_of: dict[str, _Group],
    options: dict[str, Any],
) -> list[tuple[str, str]]:
    """(stored name, model name) for model tensors the checkpoint holds only under their
    canonical name, as fastload's saver records it (``fastload.tied``). A model that ties them
    loads them with the canonical one already; a model that does not gets a copy for each."""
    records = [(f.path, (f.metadata() or {}).get(TIED_KEY)) for f in ckpt.files]
    index_meta = ckpt.location.index_metadata or {}
    records.append((str(ckpt.location.index), index_meta.get(TIED_KEY)))
    aliases = keymod.recorded_aliases(r for r in records if r[1] is not None)
    stored_only = [a for a, canonical in aliases.items() if canonical in ckpt.tensors]
    if not stored_only:
        return []
    loaded = {id(group_of[m]) for m in mapping.to_model.values()}
    pairs = []
    for alias, model_name in keymod.map_keys(stored_only, model_keys, **options).to_model.items():
        group = group_of[model_name]
        if id(group) not in loaded:  # one source per group: its other names share it
            loaded.add(id(group))
            pairs.append((aliases[alias], model_name))
    return pairs


def _check_dtype(
    ckpt: OpenCheckpoint, stored: StoredTensor, model_name: str, template: torch.Tensor
) -> None:
    """Integer, boolean and float8 tensors load only into tensors of their own dtype: the copy
    engine converts between F32/F16/BF16/F64 only, and reinterpreting would corrupt values."""
    model_st = to_st(template.dtype)
    if stored.st_dtype == model_st:
        return
    if stored.st_dtype in CONVERTIBLE and model_st in CONVERTIBLE:
        return
    raise CheckpointError(
        f"{ckpt.file_path(stored)}: tensor {stored.name!r} is stored as {stored.st_dtype} but the "
        f"model's {model_name!r} is {model_st}; fastload converts only between F32, F16, BF16 "
        "and F64"
    )


def _source_bytes(stored: StoredTensor, dest: Destination) -> int:
    if dest.selection is None:
        return stored.nbytes
    total = math.prod(stored.shape) or 1
    return stored.nbytes * math.prod(selected_shape(stored.shape, dest.selection)) // total


def _apply_policies(report: LoadReport, missing: str, unexpected: str, source: str) -> None:
    if report.unexpected:
        names = keymod.format_names(report.unexpected)
        if unexpected == "error":
            raise CheckpointError(
                f"{source}: {len(report.unexpected)} checkpoint tensors have no place in the "
                f"model: {names}"
            )
        if unexpected == "warn":
            logger.warning(
                "%s: %d checkpoint tensors are not used by the model: %s",
                source,
                len(report.unexpected),
                names,
            )
    if report.missing:
        names = keymod.format_names(report.missing)
        if missing == "error":
            raise CheckpointError(
                f"{source}: {len(report.missing)} model tensors are not in the checkpoint: {names}"
            )
        log = logger.warning if missing == "warn" else logger.info
        log(
            "%s: %d model tensors are not in the checkpoint and are initialized: %s",
            source,
            len(report.missing),
            names,
        )


# --------------------------------------------------------------------------------------------
# Allocating and reading.
# --------------------------------------------------------------------------------------------


def _allocate(
    groups: list[_Group],
    placement: Placement,
    shared: OpenCheckpoint | None = None,
    report: LoadReport | None = None,
    mmap: str = "shared",
) -> dict[int, list[tuple[str, torch.Tensor, Selection, int]]]:
    """Allocates every new tensor once; returns the fill items per file index
    (tensor name, destination, selection, source bytes).

    With ``shared``, a whole CPU tensor stored in its wanted dtype in a file that ``mmap`` lets
    be mapped (:func:`~fastload.sharing.file_sharing`) is a view of a copy-on-write mapping of its
    file instead, and needs no copy; the views' uncached pages are then read ahead."""
    from fastload.sharing import SharedMapping, file_sharing

    mappings: dict[int, SharedMapping] = {}
    sharing = {i: file_sharing(f, mmap) for i, f in enumerate(shared.files)} if shared else {}
    viewed: set[str] = set()  # an untied alias of a stored tensor gets a copy, not a second view
    by_file: dict[int, list[tuple[str, torch.Tensor, Selection, int]]] = {}
    for group in groups:
        first = group.slots[0]
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
                if tensor is None:
                    shape = selected_shape(stored.shape, dest.selection)
                    tensor = torch.empty(shape, dtype=dest.dtype, device=dest.device)
                    by_file.setdefault(stored.file, []).append(
                        (stored.name, tensor, dest.selection, _source_bytes(stored, dest))
                    )
                elif report is not None:
                    report.bytes_shared += tensor.numel() * tensor.element_size()
                if i == 0:
                    group.dest, group.new = dest, tensor
                else:
                    group.extra.append((slot, tensor))
            continue
        dest = placement.destination(first.name, group.template, None, is_buffer=first.is_buffer)
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
    for mapping in mappings.values():
        mapping.prefetch()
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


def _show_progress(total: int, enabled: bool) -> bool:
    if not enabled:
        return False
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return total > PROGRESS_MIN_BYTES or tty


def _read(
    ckpt: OpenCheckpoint,
    by_file: dict[int, list[tuple[str, torch.Tensor, Selection, int]]],
    *,
    threads: int | None,
    progress: bool,
) -> int:
    """One copy call per file (all its tensors at once, so the engine parallelises across them)."""
    from tqdm.auto import tqdm

    from fastload.reader import fill

    total = sum(b for items in by_file.values() for *_, b in items)
    written = 0
    with tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="fastload",
        disable=not _show_progress(total, progress),
        file=sys.stderr,
    ) as bar:
        for index in sorted(by_file):
            items = by_file[index]
            written += fill(ckpt.files[index], [(n, t, s) for n, t, s, _ in items], threads)
            bar.update(sum(b for *_, b in items))
    return written


def _resolve_duplicates(groups: list[_Group]) -> None:
    """A tie group stored more than once: equal copies stay tied; different ones are untied, as
    transformers does (the checkpoint, not the config, is the truth about the values)."""
    for group in groups:
        if not group.extra or group.new is None:
            continue
        canonical = group.sources[0][0]
        for slot, tensor in group.extra:
            if slot.key == canonical.key:
                continue  # the same storage place under two names: nothing to untie
            same = tensor.shape == group.new.shape and torch.equal(
                tensor.to(group.new.device, group.new.dtype), group.new
            )
            if not same:
                logger.warning(
                    "%s and %s are tied in the model but stored with different values; "
                    "they are loaded untied",
                    canonical.name,
                    slot.name,
                )
                group.untied.append(slot)


# --------------------------------------------------------------------------------------------
# Finishing.
# --------------------------------------------------------------------------------------------


def _as_parameter(tensor: torch.Tensor, template: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=template.requires_grad)
    extra = {k: v for k, v in template.__dict__.items() if k != "_is_hf_initialized"}
    param.__dict__.update(extra)
    return param


def _wrap(group: _Group, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if group.is_buffer else _as_parameter(tensor, group.template)


def _finish(model: nn.Module, groups: list[_Group], report: LoadReport) -> None:
    """Swaps the new tensors in (all together), initializes, and checks nothing is on meta; on
    any failure the model's original tensors are put back."""
    swap = _Swap()
    try:
        targets: dict[str, torch.Tensor] = {}
        for group in groups:
            if group.new is None:
                continue
            value = _wrap(group, group.new)
            # An untied member gets its own loaded tensor; names sharing its storage place follow.
            extras = dict((s.name, t) for s, t in group.extra)
            own = {s.key: _wrap(group, extras[s.name]) for s in group.untied}
            for slot in group.slots:
                swap.set(slot, own.get(slot.key, value))
            if group.action == "init":
                targets[group.slots[0].name] = value
        initialize(model, targets)
        _check_no_meta(model)
    except BaseException:
        swap.rollback()
        raise
    report.initialized = [n for g in groups if g.action == "init" for n in g.names]
    report.tied = [[s.name for s in g] for g in group_slots(tensor_slots(model)) if len(g) > 1]


def _check_no_meta(model: nn.Module) -> None:
    left = [s.name for s in tensor_slots(model) if s.tensor.device.type == "meta"]
    if left:
        raise FastloadError(
            f"{type(model).__name__}: {len(left)} tensors are still on the meta device after "
            f"loading: {keymod.format_names(left)}; they are neither in the checkpoint nor "
            "computed by the model's __init__"
        )


def _finish_transformers(
    model: nn.Module, directory: Path, *, load_generation_config: bool
) -> None:
    """Leaves the state transformers' from_pretrained leaves: tensors flagged as initialized and,
    for a model fastload built, the generation config of the checkpoint directory."""
    mark_initialized(model)
    if not load_generation_config:
        return
    generation = directory / "generation_config.json"
    can_generate = getattr(model, "can_generate", None)
    if generation.is_file() and callable(can_generate) and can_generate():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))
