"""The load plan: which checkpoint tensor fills which model tensor, and what happens to the rest.

The model's tensors are grouped by identity (a tie group is one tensor under several names); every
group is loaded, initialized or kept. Checkpoint names are mapped onto model names by
:mod:`fastload.keys`, shapes and dtypes are checked before anything is allocated, and the missing /
unexpected policies are applied. The result is the list of groups and the :class:`LoadReport`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fastload import keys as keymod
from fastload.checkpoint import OpenCheckpoint, StoredTensor
from fastload.dtypes import CONVERTIBLE, to_st
from fastload.errors import CheckpointError, ModelMismatchError, UnsupportedError
from fastload.hooks import ModelHooks
from fastload.placement import Destination, Placement, selected_shape
from fastload.report import LoadReport
from fastload.saving import TIED_KEY
from fastload.tying import Slot, group_slots, tensor_slots

logger = logging.getLogger("fastload")


@dataclass
class Group:
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
    # a tensor assembled from stored pieces (merged MoE experts, a split fused qkv)
    pieces: list[StoredPiece] | None = None

    @property
    def is_buffer(self) -> bool:
        return self.slots[0].is_buffer

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def keyed(self) -> list[str]:
        """Names that belong in a state dict (parameters and persistent buffers)."""
        return [s.name for s in self.slots if not s.is_buffer or s.persistent]


#: one step from a model tensor to the part a piece fills: ("select", dim, index) or
#: ("narrow", dim, start, length)
View = tuple[Any, ...]


@dataclass
class Piece:
    """One stored tensor (or the part ``selection``, ``(dim, start, stop)``, takes of it) and
    the part of a model tensor it fills."""

    stored: str
    views: tuple[View, ...]
    selection: tuple[int, int, int] | None = None


@dataclass
class Merge:
    """A model tensor assembled from pieces of stored tensors (a model family's conversions:
    transformers' merged MoE experts, split fused ``qkv``; see :meth:`ModelHooks.merges`)."""

    target: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


@dataclass(frozen=True)
class StoredPiece:
    """A :class:`Piece` resolved against the checkpoint: what the copy engine reads, and where."""

    stored: StoredTensor
    views: tuple[View, ...]
    selection: list[int] | None
    nbytes: int

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the model tensor ``tensor`` this piece fills (a view of it)."""
        for step in self.views:
            if step[0] == "select":
                tensor = tensor.select(step[1], step[2])
            else:
                tensor = tensor.narrow(step[1], step[2], step[3])
        return tensor


def _authorization(model: nn.Module, extra_unexpected: list[str]) -> keymod.Authorization:
    # The attribute names are transformers', but any model class may declare them.
    unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    unexpected += extra_unexpected
    return keymod.Authorization(
        missing=keymod.compile_patterns(getattr(model, "_keys_to_ignore_on_load_missing", None)),
        unexpected=keymod.compile_patterns(unexpected),
    )


def plan(
    model: nn.Module,
    ckpt: OpenCheckpoint,
    placement: Placement,
    *,
    key_map: keymod.Rename | None,
    missing_policy: str,
    unexpected_policy: str,
    ignore_mismatched_sizes: bool,
    source: str,
    hooks: ModelHooks,
) -> tuple[list[Group], LoadReport]:
    """Matches checkpoint tensors to model tensors, checks shapes and dtypes, applies the key
    policies, and decides what happens to every tensor group (load, initialize, keep)."""
    slots = tensor_slots(model)
    groups = [Group(slots=g, template=g[0].tensor) for g in group_slots(slots)]
    group_of = {s.name: g for g in groups for s in g.slots}
    slot_of = {s.name: s for s in slots}
    position = {s.name: i for g in groups for i, s in enumerate(g.slots)}
    model_keys = {n for g in groups for n in g.keyed()}
    computed = {s.name for s in slots if s.is_buffer and not s.persistent}
    prefix = getattr(model, "base_model_prefix", None) or None

    options: dict[str, Any] = {
        "base_model_prefix": prefix,
        "key_map": key_map,
        "renames": hooks.renames(model, source),
        "source": source,
        "computed": computed,
        "collision_order": hooks.collision_order(),
    }
    merges = hooks.merges(model, ckpt, model_keys, options)
    merged = {p.stored for m in merges.values() for p in m.pieces}
    names = [n for n in ckpt.tensors if n not in merged] if merged else ckpt.tensors
    mapping = keymod.map_keys(names, model_keys, **options)
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
    for merge in merges.values():
        _add_merge(merge, ckpt, placement, group_of[merge.target], slot_of[merge.target])
        report.renamed.update((p.stored, merge.target) for p in merge.pieces)
    if wrong and not ignore_mismatched_sizes:
        shown = "\n  ".join(wrong[:20]) + (
            f"\n  ... ({len(wrong) - 20} more)" if len(wrong) > 20 else ""
        )
        error = ModelMismatchError(
            f"{len(wrong)} checkpoint tensors do not have the model's shape (pass "
            f"ignore_mismatched_sizes=True to re-initialize them instead):\n  {shown}"
        )
        error.mismatched = list(report.mismatched)  # (model name, checkpoint, model shape)
        raise error
    mismatched = {m[0] for m in report.mismatched}

    # Unexpected checkpoint tensors.
    auth = _authorization(model, hooks.authorized_unexpected(model, slots))
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

    if (
        not pairs
        and not merges
        and ckpt.tensors
        and model_keys
        and not report.mismatched
        and hooks.refuse_no_match()
    ):
        raise CheckpointError(
            f"{source}: none of its {len(ckpt.tensors)} tensors matches a tensor of "
            f"{type(model).__name__} (checkpoint names such as "
            f"{keymod.format_names(sorted(ckpt.tensors), 3)}; model names such as "
            f"{keymod.format_names(sorted(model_keys), 3)}): a checkpoint of another model, or the "
            "wrong file"
        )
    _apply_policies(report, missing_policy, unexpected_policy, source)
    report.tensors_loaded = sum(len(g.sources) for g in groups)
    report.bytes_read = sum(
        source_bytes(stored, dest)
        for g in groups
        if g.pieces is None
        for _, stored, dest in g.sources
    ) + sum(p.nbytes for g in groups for p in g.pieces or ())
    return groups, report


def _add_merge(
    merge: Merge, ckpt: OpenCheckpoint, placement: Placement, group: Group, slot: Slot
) -> None:
    """Makes ``group`` load from the pieces of ``merge``, after checking shape and dtypes."""
    stored = [ckpt.tensors[p.stored] for p in merge.pieces]
    want = tuple(group.template.shape)
    if merge.shape != want:
        raise CheckpointError(
            f"{ckpt.file_path(stored[0])}: tensor {stored[0].name!r} and {len(stored) - 1} "
            f"others make a tensor of shape {list(merge.shape)}, but the model's "
            f"{merge.target!r} has shape {list(want)}"
        )
    for t in stored:
        _check_dtype(ckpt, t, merge.target, group.template)
    dest = placement.destination(merge.target, group.template, stored[0], is_buffer=slot.is_buffer)
    if dest.selection is not None:
        raise UnsupportedError(
            f"{ckpt.file_path(stored[0])}: tensor {stored[0].name!r} is merged into or split "
            f"from {merge.target!r}, which tp_plan shards; fastload does not shard such tensors"
        )
    group.sources.append((slot, stored[0], dest))
    group.pieces = []
    for t, p in zip(stored, merge.pieces, strict=True):
        nbytes = t.nbytes
        if p.selection is not None:
            dim, start, stop = p.selection
            nbytes = t.nbytes * (stop - start) // max(t.shape[dim], 1)
        selection = None if p.selection is None else list(p.selection)
        group.pieces.append(StoredPiece(t, p.views, selection, nbytes))


def _alias_pairs(
    ckpt: OpenCheckpoint,
    mapping: keymod.KeyMapping,
    model_keys: set[str],
    group_of: dict[str, Group],
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


def source_bytes(stored: StoredTensor, dest: Destination) -> int:
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
