"""Putting the loaded tensors into the model: all at once, or not at all.

Every member of a tie group gets the same Parameter (a tie stored twice with different values is
untied: the checkpoint, not the config, is the truth about the values); missing tensors are
initialized the model's own way; nothing may be left on ``meta``. A failure while swapping or
initializing puts every original tensor back, so a module passed in is never left half-loaded."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from fastload.core.basics.errors import FastloadError
from fastload.core.model import keys as keymod
from fastload.core.model.skeleton import FamilyInit, initialize
from fastload.core.model.tying import Slot, group_slots, same_values, tensor_slots
from fastload.core.plan.actions import Action
from fastload.core.plan.load_plan import Group
from fastload.core.plan.report import LoadReport

logger = logging.getLogger("fastload")


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


def resolve_duplicates(groups: list[Group]) -> None:
    """A tie group stored more than once: equal copies stay tied; different ones are untied (the
    checkpoint, not the config, is the truth about the values)."""
    for group in groups:
        if not group.extra or group.new is None:
            continue
        canonical = group.sources[0].slot
        for slot, tensor in group.extra:
            if slot.key == canonical.key:
                continue  # the same storage place under two names: nothing to untie
            if not same_values(tensor, group.new):
                logger.warning(
                    "%s and %s are tied in the model but stored with different values; "
                    "they are loaded untied",
                    canonical.name,
                    slot.name,
                )
                group.untied.append(slot)


def _as_parameter(
    tensor: torch.Tensor, template: torch.Tensor, dropped: Collection[str]
) -> nn.Parameter:
    param = nn.Parameter(tensor, requires_grad=template.requires_grad)
    extra = {k: v for k, v in template.__dict__.items() if k not in dropped}
    param.__dict__.update(extra)
    return param


def _wrap(group: Group, tensor: torch.Tensor, dropped: Collection[str]) -> torch.Tensor:
    return tensor if group.is_buffer else _as_parameter(tensor, group.template, dropped)


def swap_in(
    model: nn.Module,
    groups: list[Group],
    report: LoadReport,
    offloaded: set[str] | None = None,
    family: FamilyInit | None = None,
    dropped: Collection[str] = (),
) -> None:
    """Swaps the new tensors in (all together), initializes (the model family's way first,
    ``family``), and checks nothing is on meta; on any failure the model's original tensors are
    put back. A loaded parameter takes over the attributes of the skeleton's, except those named
    in ``dropped`` (:meth:`fastload.core.plan.hooks.ModelHooks.dropped_attributes`)."""
    swap = _Swap()
    try:
        targets: dict[str, torch.Tensor] = {}
        for group in groups:
            if group.new is None:
                continue
            value = _wrap(group, group.new, dropped)
            # An untied member gets its own loaded tensor; names sharing its storage place follow.
            extras = dict((s.name, t) for s, t in group.extra)
            own = {s.key: _wrap(group, extras[s.name], dropped) for s in group.untied}
            for slot in group.slots:
                swap.set(slot, own.get(slot.key, value))
            if group.action == Action.INIT:
                targets[group.slots[0].name] = value
        initialize(model, targets, family)
        slots = tensor_slots(model)  # one walk for the check and the report
        _check_no_meta(model, slots, offloaded or set())
    except BaseException:
        swap.rollback()
        raise
    report.initialized = [n for g in groups if g.action == Action.INIT for n in g.names]
    report.tied = [[s.name for s in g] for g in group_slots(slots) if len(g) > 1]


def _check_no_meta(model: nn.Module, slots: list[Slot], offloaded: set[str]) -> None:
    """Nothing but the tensors offloaded to disk may be left on ``meta``."""
    left = [s.name for s in slots if s.tensor.device.type == "meta" and s.name not in offloaded]
    if left:
        raise FastloadError(
            f"{type(model).__name__}: {len(left)} tensors are still on the meta device after "
            f"loading: {keymod.format_names(left)}; they are neither in the checkpoint nor "
            "computed by the model's __init__"
        )
