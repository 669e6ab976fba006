"""``device_map``: which device each model tensor is loaded onto.

A device map is a dict of module-name prefix -> device. A tensor goes to the device of the longest
prefix that contains it (``"model.layers.1"`` contains ``model.layers.1.mlp.up_proj.weight`` but not
``model.layers.10...``; the prefix ``""`` contains everything).
:func:`~fastload.core.devices.resolution.resolve_device_map` turns what a user passes to
``from_pretrained(device_map=...)`` into a checked :class:`DeviceMap`:

* ``"cpu"``, ``"cuda:1"``, an int or a ``torch.device``: everything on that device;
* a dict ``{prefix: device}``: every prefix must name a module or tensor of the model, and every
  tensor must be covered by one;
* ``"auto"``: :func:`~fastload.core.devices.resolution.plan_auto` fills the devices in order, GPUs
first (most free memory first),
  then the CPU, keeping each no-split block (a class the model lists in ``_no_split_modules``,
  e.g. a decoder layer) whole on one device.

:func:`fastload.core.devices.dispatch.dispatch` lets a model split over devices run:
it moves each module's inputs to the device its weights are on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fastload.core.basics.errors import RequestError, UnsupportedError
from fastload.core.devices.checks import parse_device
from fastload.core.model.keys import within

logger = logging.getLogger("fastload")

DeviceLike = str | int | torch.device


class Disk:
    """The place of tensors a device map offloads to disk: they are not allocated, stay on
    ``meta`` in the model, and are read from the checkpoint file when their module runs
    (accelerate's offload hooks, :mod:`fastload.core.reads.offload`). Not a ``torch.device``:
    nothing can be allocated there by mistake."""

    type = "disk"
    index = None

    def __repr__(self) -> str:
        return "DISK"

    def __str__(self) -> str:
        return "disk"


#: the one :class:`Disk`
DISK = Disk()
#: where a device map puts a tensor
Place = torch.device | Disk
DeviceMapArg = DeviceLike | Mapping[str, DeviceLike]


def map_device(device: DeviceLike, *, where: str = "device_map", disk: bool = False) -> Place:
    """A device of a device map (or a ``max_memory`` key): ``"disk"`` is :data:`DISK` when
    ``disk`` allows it, anything else is parsed by
    :func:`fastload.core.devices.checks.parse_device`, the one parser of devices (a device that does
    not exist fails before anything is allocated)."""
    if isinstance(device, str) and device.strip().lower() == "disk":
        if disk:
            return DISK
        raise UnsupportedError(
            f"{where}: offloading to disk needs offload_folder= (and accelerate installed)"
        )
    return parse_device(device, where=where)


# --------------------------------------------------------------------------------------------
# The "auto" planner: a pure function.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceMap:
    """A checked device map: ``device_of(name)`` is the device of the longest containing prefix."""

    prefixes: dict[str, Place]

    def device_of(self, name: str) -> Place:
        best: str | None = None
        for prefix in self.prefixes:
            if within(prefix, name) and (best is None or len(prefix) > len(best)):
                best = prefix
        if best is None:
            raise RequestError(f"device_map: no entry covers tensor {name!r}")
        return self.prefixes[best]

    @property
    def devices(self) -> list[Place]:
        """The distinct devices used, in map order."""
        out: list[Place] = []
        for dev in self.prefixes.values():
            if dev not in out:
                out.append(dev)
        return out

    def as_strings(self) -> dict[str, str]:
        """``{prefix: "cuda:0"}``, e.g. for a report or ``json.dumps``."""
        return {k: str(v) for k, v in self.prefixes.items()}

    def accelerate_map(self) -> dict[str, int | str]:
        """The map as accelerate writes it (a model's recorded device map): CUDA devices by
        index, others by type, ``"disk"``."""
        out: dict[str, int | str] = {}
        for prefix, device in self.prefixes.items():
            if device == DISK:
                out[prefix] = "disk"
            else:
                out[prefix] = (device.index or 0) if device.type == "cuda" else str(device)
        return out

    @property
    def has_disk(self) -> bool:
        """Whether some tensors are offloaded to disk."""
        return DISK in self.prefixes.values()


__all__ = [
    "DISK",
    "DeviceLike",
    "DeviceMap",
    "DeviceMapArg",
    "Disk",
    "Place",
    "map_device",
]
