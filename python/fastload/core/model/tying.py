"""Tied weights: finding tie groups on a model and re-tying them after a meta-device load.

Loading onto the meta device breaks ties: ``a.weight = b.weight`` aliasing on
meta does not survive replacing one parameter with a loaded one. This module finds the groups (by
Parameter identity, before loading); :func:`fastload.core.finishing.swap_in` points every
member at the loaded canonical Parameter after.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


def find_tie_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are the same Parameter object, one list per group of 2 or more.

    Each group is in ``named_parameters`` order, so its first name is the one
    ``model.state_dict()``/``named_parameters()`` reports first.
    """
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def same_values(member: torch.Tensor, canonical: torch.Tensor) -> bool:
    """Whether a further stored member of a tie group holds the canonical member's values (in
    its dtype, on its device): a tie stored twice stays one tensor only then (a load unties the
    two otherwise, a reload refuses the checkpoint)."""
    return member.shape == canonical.shape and torch.equal(
        member.to(canonical.device, canonical.dtype), canonical
    )


class Slot(NamedTuple):
    """One place a model holds a tensor: ``module.<attr>``, reached by the dotted ``name``.

    Tied parameters are several slots holding the same Parameter object; a module shared under two
    names gives two slots with the same ``module`` and ``attr``. (A named tuple: a load makes one
    per tensor several times, and a frozen dataclass costs ~5x as much to build.)
    """

    name: str
    module: nn.Module
    attr: str
    is_buffer: bool
    persistent: bool  # False for a non-persistent buffer (never in a state dict)

    @property
    def tensor(self) -> torch.Tensor:
        store = self.module._buffers if self.is_buffer else self.module._parameters
        return store[self.attr]

    @property
    def key(self) -> tuple[int, str]:
        """Identifies the storage place itself (same for a module shared under two names)."""
        return (id(self.module), self.attr)


def tensor_slots(model: nn.Module) -> list[Slot]:
    """Every parameter and buffer slot of ``model``, tied and shared ones included, in
    ``named_parameters``/``named_buffers`` order (parameters of a module before its buffers)."""
    out: list[Slot] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, param in module._parameters.items():
            if param is not None:
                out.append(Slot(dot + attr, module, attr, False, True))
        for attr, buf in module._buffers.items():
            if buf is not None:
                persistent = attr not in module._non_persistent_buffers_set
                out.append(Slot(dot + attr, module, attr, True, persistent))
    return out


def group_slots(slots: list[Slot]) -> list[list[Slot]]:
    """Slots grouped by the identity of the tensor they hold, in order of first appearance."""
    groups: dict[int, list[Slot]] = {}
    for slot in slots:
        groups.setdefault(id(slot.tensor), []).append(slot)
    return list(groups.values())
