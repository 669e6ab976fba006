"""The load plan: which checkpoint tensor fills which model tensor, how, and what happens to
the rest.

The model's tensors are grouped by identity (a tie group is one tensor under several names); every
group is loaded, initialized or kept. Checkpoint names are mapped onto model names by
:mod:`fastload.core.model.keys`, shapes and dtypes are checked before anything is allocated, and the
missing / unexpected policies are applied. Each loaded tensor gets its destination
(:mod:`fastload.core.plan.placement`) and its mode: a view of the file's mapping, a copy, a
conversion, a slice (a tensor-parallel shard), pieces merged into one tensor, or left on disk
(offloaded; :mod:`fastload.core.plan.modes` decides which).

The result, a :class:`~fastload.core.plan.load_plan.LoadPlan`, is the one record of these
decisions: allocation, reading and finishing consume it and decide nothing again; the
:class:`LoadReport`'s counts are derived from it once.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fastload.core.basics.dtypes import CONVERTIBLE, to_st
from fastload.core.basics.errors import CheckpointError, ModelMismatchError, UnsupportedError
from fastload.core.checkpoint.opened import OpenCheckpoint, StoredTensor
from fastload.core.devices.device_map import DISK
from fastload.core.memory.sharing import file_sharing
from fastload.core.model import keys as keymod
from fastload.core.model.tying import Slot, group_slots, tensor_slots
from fastload.core.plan.actions import Action, Mode
from fastload.core.plan.hooks import Merge, ModelHooks
from fastload.core.plan.load_options import LoadOptions
from fastload.core.plan.load_plan import Group, LoadPlan, Source, StoredPiece
from fastload.core.plan.modes import count, decide_modes
from fastload.core.plan.placement import Destination, Placement
from fastload.core.plan.report import LoadReport

logger = logging.getLogger("fastload")


def _authorization(model: nn.Module, extra_unexpected: list[str]) -> keymod.Authorization:
    # Conventional attribute names that any model class may declare.
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
    options: LoadOptions,
    *,
    source: str,
    hooks: ModelHooks,
    later: set[str] = frozenset(),  # type: ignore[assignment]
) -> LoadPlan:
    """Matches checkpoint tensors to model tensors, checks shapes and dtypes, applies the key
    policies, and decides what happens to every tensor group (load, initialize, keep) and how
    each loaded tensor is read."""
    slots = tensor_slots(model)
    groups = [Group(slots=g, template=g[0].tensor) for g in group_slots(slots)]
    group_of = {s.name: g for g in groups for s in g.slots}
    slot_of = {s.name: s for s in slots}
    position = {s.name: i for g in groups for i, s in enumerate(g.slots)}
    model_keys = {n for g in groups for n in g.keyed()}
    # buffers the model computes, and names its family fills after the load (FamilyShards)
    computed = {s.name for s in slots if s.is_buffer and not s.persistent} | set(later)
    prefix = getattr(model, "base_model_prefix", None) or None

    rules = keymod.KeyRules(
        base_model_prefix=prefix,
        key_map=options.key_map,
        renames=hooks.renames(model, source),
        source=source,
        computed=computed,
        collision_order=hooks.collision_order(),
        resolve=hooks.resolve_names(model),
    )
    merges = hooks.merges(model, ckpt, model_keys, rules)
    operations = hooks.operations(model, ckpt, model_keys, rules)
    later = set(later) | set(operations)  # filled by the family's operations after the read
    merged = {p.stored for m in merges.values() for p in m.pieces}
    merged |= {name for op in operations.values() for name in op.inputs}
    names = [n for n in ckpt.tensors if n not in merged] if merged else ckpt.tensors
    mapping = keymod.map_keys(names, model_keys, rules)
    report = LoadReport(renamed=mapping.renamed)
    pairs = list(mapping.to_model.items())
    pairs += _alias_pairs(ckpt, mapping, model_keys, group_of, rules)

    # Sources, with shapes checked against the model before anything is allocated.
    wrong: list[str] = []
    for ckpt_name, model_name in pairs:
        stored = ckpt.tensors[ckpt_name]
        group, slot = group_of[model_name], slot_of[model_name]
        dest = placement.destination(model_name, group.template, stored, is_buffer=slot.is_buffer)
        # A selection (a tensor-parallel shard) is taken from the model's full shape: the stored
        # tensor must have that full shape.
        got, want = _torch_shape(ckpt, stored), tuple(group.template.shape)
        if got != want:
            report.mismatched.append((model_name, got, want))
            wrong.append(
                f"{ckpt.file_path(stored)}: tensor {ckpt_name!r} has shape {list(got)}, the "
                f"model's {model_name!r} has shape {list(want)}"
            )
            continue
        _check_dtype(ckpt, stored, model_name, group.template)
        group.sources.append(Source(slot, stored, dest))
    for merge in merges.values():
        _add_merge(merge, ckpt, placement, group_of[merge.target], slot_of[merge.target])
        report.renamed.update((p.stored, merge.target) for p in merge.pieces)
    if wrong and not options.ignore_mismatched_sizes:
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
        if mapped != ckpt_name:
            report.unexpected_renamed[ckpt_name] = mapped
        if auth.unexpected_declared(ckpt_name, mapped):
            report.authorized_unexpected.append(ckpt_name)
        elif mapped in computed or ckpt_name in computed or keymod.declined(model, mapped, prefix):
            # expected (a buffer the model computes, a layer it does not build), though the
            # model class does not say so
            report.authorized_unexpected.append(ckpt_name)
            report.inferred_unexpected.append(ckpt_name)
        else:
            report.unexpected.append(ckpt_name)

    # What each group does, and missing model tensors.
    tie_order = hooks.tie_source_order(model)
    for group in groups:
        group.sources.sort(key=lambda s: position[s.slot.name])
        if tie_order is not None and len(group.sources) > 1:
            group.sources.sort(key=lambda s: tie_order(s.slot.name))
        if group.sources:
            group.action = Action.LOAD
            continue
        reinit = any(n in mismatched for n in group.names)
        if not reinit and not set(group.names) <= later:  # later: the family fills it after
            for name in group.keyed():  # a mismatched tensor is reported as such, not missing
                listed = report.authorized_missing if auth.missing_ok(name) else report.missing
                listed.append(name)
        meta = group.template.device.type == "meta" and not set(group.names) <= later
        if meta or (reinit and not group.is_buffer):
            group.action = Action.INIT
        first = group.slots[0]
        dest = placement.destination(first.name, group.template, None, is_buffer=first.is_buffer)
        if dest.device == DISK:  # not in the file: kept in memory, served to the offload hooks
            dest = Destination(torch.device("cpu"), dest.dtype, dest.selection)
        group.dest = dest

    if (
        not pairs
        and not (merges or operations)
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
    _apply_policies(report, options.missing, options.unexpected, source)
    if options.collective:  # every rank reads its part into copies
        why = "copies (a collective load: each rank reads its part of the file)"
        sharing = {i: (False, why) for i in range(len(ckpt.files))}
    else:
        sharing = {i: file_sharing(f, options.mmap) for i, f in enumerate(ckpt.files)}
    out = LoadPlan(groups, report, sharing, set(operations))
    decide_modes(out, ckpt)
    count(out, ckpt)
    return out


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
    group.sources.append(Source(slot, stored[0], dest, Mode.MERGE))
    group.pieces = []
    for t, p in zip(stored, merge.pieces, strict=True):
        nbytes = t.nbytes
        if p.selection is not None:
            dim, start, stop = p.selection
            nbytes = t.nbytes * (stop - start) // max(t.torch_shape[dim], 1)
        selection = None if p.selection is None else list(p.selection)
        group.pieces.append(StoredPiece(t, p.views, selection, nbytes))


def _alias_pairs(
    ckpt: OpenCheckpoint,
    mapping: keymod.KeyMapping,
    model_keys: set[str],
    group_of: dict[str, Group],
    rules: keymod.KeyRules,
) -> list[tuple[str, str]]:
    """(stored name, model name) for model tensors the checkpoint holds only under their
    canonical name, as fastload's saver records it (``fastload.tied``). A model that ties them
    loads them with the canonical one already; a model that does not gets a copy for each."""
    records = [(f.path, (f.metadata() or {}).get(keymod.TIED_KEY)) for f in ckpt.files]
    index_meta = ckpt.location.index_metadata or {}
    records.append((str(ckpt.location.index), index_meta.get(keymod.TIED_KEY)))
    aliases = keymod.recorded_aliases(r for r in records if r[1] is not None)
    stored_only = [a for a, canonical in aliases.items() if canonical in ckpt.tensors]
    if not stored_only:
        return []
    loaded = {id(group_of[m]) for m in mapping.to_model.values()}
    pairs = []
    for alias, model_name in keymod.map_keys(stored_only, model_keys, rules).to_model.items():
        group = group_of[model_name]
        if id(group) not in loaded:  # one source per group: its other names share it
            loaded.add(id(group))
            pairs.append((aliases[alias], model_name))
    return pairs


def _torch_shape(ckpt: OpenCheckpoint, stored: StoredTensor) -> tuple[int, ...]:
    """``stored``'s torch shape; ``UnsupportedError`` naming its file where torch has no tensor
    of that shape (a packed dtype whose last dimension does not pack)."""
    try:
        return stored.torch_shape
    except UnsupportedError as e:
        raise UnsupportedError(f"{ckpt.file_path(stored)}: {e}") from None


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
