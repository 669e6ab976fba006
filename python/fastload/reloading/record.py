"""What a load decided, kept beside the model so that :func:`fastload.reload` decides it again
identically: which stored tensor (and which part of it) fills which model tensor, the options the
checkpoint was read with, and the digests the checkpoint carried.

The record is made at the end of every load (:func:`remember`, called by
:func:`fastload.core.loading.load`) and kept in a weak table keyed by the module: the module's own
attributes, its pickling and ``state_dict`` are untouched, and the record goes with the module.
It names model tensors, never holds them: a reload finds each tensor by its name in the model as
it is then (after dispatch, tensor-parallel wrapping or the family's finishing), so the memory a
reload writes is the memory the model runs on.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from fastload.core.checkpoint.digests import file_digests
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor
from fastload.core.plan.actions import Action, Mode
from fastload.core.plan.hooks import View
from fastload.core.plan.load_options import LoadOptions
from fastload.core.plan.load_plan import LoadPlan
from fastload.core.plan.placement import Selection

__all__ = [
    "Part",
    "Entry",
    "LoadRecord",
    "remember",
    "Remember",
    "ResolveId",
    "record_of",
    "one_at_a_time",
    "checkpoint_digests",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Part:
    """One stored tensor that fills a model tensor, or the part ``views`` of it (a merge)."""

    stored: str
    st_dtype: str
    shape: tuple[int, ...]
    selection: Selection
    views: tuple[View, ...] = ()


@dataclass(frozen=True)
class Entry:
    """A model tensor (by name) and the stored tensors that fill it (one, or a merge's pieces)."""

    name: str
    parts: tuple[Part, ...]

    @property
    def merged(self) -> bool:
        return len(self.parts) > 1 or bool(self.parts[0].views)


@dataclass
class LoadRecord:
    """What the load (or the last successful reload) of a model decided and read."""

    entries: list[Entry]
    #: every tensor name of the checkpoint that made the model (used or not)
    names: set[str]
    #: stored name -> digest, for the tensors whose file carried one
    digests: dict[str, str]
    #: how the checkpoint was read: read_mode, allow_pickle, storage_options, threads
    read_mode: str
    allow_pickle: bool
    storage_options: Mapping[str, object] | None
    threads: int | None
    source: str
    #: why this model cannot be reloaded (``None``: it can)
    unsupported: str | None = None
    #: how the entry that loaded the model resolves a model id or a directory's subfolder and
    #: variant into checkpoint files (``None``: that entry resolves none)
    resolve_id: ResolveId | None = field(default=None, repr=False, compare=False)
    #: set while the model is marked torn: what refuses to run it (``remove()`` lifts it) and the
    #: tensors named
    torn: tuple[Any, list[str]] | None = field(default=None, repr=False)
    #: held by a reload of the model from start to end: reloads of one model run one at a time
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


_RECORDS: weakref.WeakKeyDictionary[nn.Module, LoadRecord] = weakref.WeakKeyDictionary()


def record_of(module: nn.Module) -> LoadRecord | None:
    """The record of ``module``'s load (``None``: fastload did not load it)."""
    return _RECORDS.get(module)


def one_at_a_time(reload: Callable[_P, _R]) -> Callable[_P, _R]:
    """``reload(model, ...)`` holding the lock of ``model``'s record: reloads of one model run one
    after the other (two at once would interleave their writes into one memory, and leave a
    record describing one of them), those of different models side by side."""

    @functools.wraps(reload)
    def serialized(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        model = args[0] if args else kwargs.get("model")
        record = record_of(model) if isinstance(model, nn.Module) else None
        if record is None:  # refused by the reload itself
            return reload(*args, **kwargs)
        with record.lock:
            return reload(*args, **kwargs)

    return serialized


def checkpoint_digests(ckpt: OpenCheckpoint) -> dict[str, str]:
    """Stored name -> digest for every tensor whose file records one."""
    out: dict[str, str] = {}
    for i, file in enumerate(ckpt.files):
        metadata = getattr(file, "metadata", None)
        recorded = file_digests(metadata() if callable(metadata) else None)
        for name, digest in recorded.items():
            stored = ckpt.tensors.get(name)
            if stored is not None and stored.file == i:
                out[name] = digest
    return out


def _part(stored: StoredTensor, selection: Selection, views: tuple[View, ...] = ()) -> Part:
    return Part(stored.name, stored.st_dtype, tuple(stored.shape), selection, views)


#: ``(source, hub options, subfolder, variant) -> the checkpoint's files`` (a path or URL)
ResolveId = Callable[[Any, Mapping[str, Any], str, "str | None"], Any]


@dataclass(frozen=True)
class Remember:
    """The record step an entry of a load passes in
    (:attr:`fastload.core.plan.steps.LoadSteps.record`), with the entry's way of resolving model
    ids, which a reload of the model then uses."""

    resolve_id: ResolveId | None = None

    def __call__(
        self,
        module: nn.Module,
        load_plan: LoadPlan,
        ckpt: OpenCheckpoint,
        options: LoadOptions,
        source: str,
    ) -> None:
        remember(module, load_plan, ckpt, options, source, resolve_id=self.resolve_id)


def remember(
    module: nn.Module,
    load_plan: LoadPlan,
    ckpt: OpenCheckpoint,
    options: LoadOptions,
    source: str,
    *,
    resolve_id: ResolveId | None = None,
) -> None:
    """Records what the load of ``module`` decided (:class:`LoadRecord`)."""
    entries: list[Entry] = []
    unsupported = None
    if load_plan.operations:
        unsupported = (
            f"tensor {min(load_plan.operations)!r} was made by an operation of the model's "
            "family (a quantizer's load operation) from stored tensors; a reload reads stored "
            "tensors as they are"
        )
    for group in load_plan.groups:
        if group.action != Action.LOAD:
            continue
        if group.pieces is not None:
            parts = tuple(_part(p.stored, p.selection, p.views) for p in group.pieces)
            entries.append(Entry(group.sources[0].slot.name, parts))
            continue
        for src in group.sources:
            if src.mode == Mode.OFFLOAD:
                unsupported = (
                    f"tensor {src.slot.name!r} is offloaded to disk (device_map with "
                    "offload_folder); a reload writes into memory the model holds"
                )
            entries.append(Entry(src.slot.name, (_part(src.stored, src.dest.selection),)))
    _RECORDS[module] = LoadRecord(
        entries=entries,
        names=set(ckpt.tensors),
        digests=checkpoint_digests(ckpt),
        read_mode=options.read_mode,
        allow_pickle=options.allow_pickle,
        storage_options=options.storage_options,
        threads=options.threads,
        source=source,
        unsupported=unsupported,
        resolve_id=resolve_id,
    )


def model_tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The memory the model runs on under ``name`` (a distributed tensor's local shard)."""
    owner, _, attr = name.rpartition(".")
    try:
        sub = module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
    tensor: torch.Tensor | None = sub._parameters.get(attr)
    if tensor is None:
        tensor = sub._buffers.get(attr)
    if tensor is None:
        return None
    to_local = getattr(tensor, "to_local", None)  # torch.distributed.tensor.DTensor
    if callable(to_local) and type(tensor).__name__ == "DTensor":
        tensor = to_local()
    return tensor.data if isinstance(tensor, nn.Parameter) else tensor
