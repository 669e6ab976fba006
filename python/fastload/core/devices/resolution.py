"""What a user passes as ``device_map`` resolved into a checked
:class:`~fastload.core.devices.device_map.DeviceMap`: ``"auto"`` planned here (:func:`plan_auto`:
the devices filled in order, GPUs first, no-split blocks kept whole), accelerate's modes by its
planner, a dict checked to cover the model, one device everywhere.

The planner is a pure function of module sizes, block boundaries and per-device budgets, so it is
tested without any GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from fastload.core.basics.errors import RequestError, UnsupportedError, from_os_error
from fastload.core.basics.units import format_bytes, parse_bytes
from fastload.core.devices.checks import parse_device
from fastload.core.devices.device_map import (
    DeviceLike,
    DeviceMap,
    DeviceMapArg,
    map_device,
)
from fastload.core.memory.budget import memory_budget
from fastload.core.model.keys import within
from fastload.core.model.tying import group_slots, tensor_slots

logger = logging.getLogger("fastload")

#: the share of a GPU's free memory "auto" plans to use by default; the rest is left for the CUDA
#: context, allocator fragmentation and activations
GPU_HEADROOM = 0.9


def plan_auto(
    sizes: Mapping[str, int],
    no_split: Iterable[str],
    budgets: Sequence[tuple[str, int | None]],
) -> dict[str, str]:
    """Assigns every unit of a model to a device, filling the devices in the order given.

    Args:
        sizes: byte size of each tensor, by dotted name (``"layers.0.mlp.up_proj.weight"``), in
            model order.
        no_split: names of modules that must stay whole on one device (a transformer block).
            A tensor inside one of them belongs to the outermost such module; any other tensor
            forms a unit with the other tensors of its module (a Linear's weight and bias).
        budgets: ``(device, bytes)`` in fill order; ``None`` bytes means no limit.

    Returns:
        ``{unit name: device}`` in model order, a device map for :func:`resolve_device_map`.

    Units are placed in model order and the planner never goes back to an earlier device: once a
    unit does not fit in what is left of a device, that device is closed and the next one is
    tried. The layers on a device are thus consecutive, and activations cross each device
    boundary once. A unit larger than every remaining budget is a ``RequestError``.
    """
    units = plan_units(sizes, no_split)
    left = [(str(device), None if b is None else int(b)) for device, b in budgets]
    if not left and units:
        raise RequestError("plan_auto: no device to place the model on")
    out: dict[str, str] = {}
    current = 0
    for unit, nbytes in units.items():
        while current < len(left):
            device, room = left[current]
            if room is None or nbytes <= room:
                out[unit] = device
                if room is not None:
                    left[current] = (device, room - nbytes)
                break
            current += 1
        else:
            budget = ", ".join(
                f"{d} {'unlimited' if b is None else format_bytes(int(b))}" for d, b in budgets
            )
            what = repr(unit) if unit else "the model's own tensors"
            raise RequestError(
                f"device_map='auto': {what} needs {format_bytes(nbytes)} "
                "and no device has that much "
                f"left (budgets: {budget}); give more memory with max_memory or map it yourself"
            )
    return out


def plan_units(sizes: Mapping[str, int], no_split: Iterable[str]) -> dict[str, int]:
    """The units :func:`plan_auto` places whole, with their bytes, in model order: each no-split
    block (outermost), else each module's own tensors."""
    blocks = sorted(set(no_split), key=len)
    units: dict[str, int] = {}
    for name, nbytes in sizes.items():
        if nbytes < 0:
            raise RequestError(f"plan_auto: size of {name!r} is negative ({nbytes})")
        block = next((b for b in blocks if within(b, name) and b != name), None)
        if block is None:
            block = name if name in blocks else name.rpartition(".")[0]
        units[block] = units.get(block, 0) + nbytes
    return units


def _plan_with_disk(
    sizes: Mapping[str, int], blocks: list[str], budgets: list[tuple[str, int | None]]
) -> dict[str, str]:
    """:func:`plan_auto`, leaving room on the main device (the first) for the largest unit when
    anything goes to disk: accelerate's hooks bring each disk-offloaded module into memory there
    while it runs, so a plan that filled that device's budget would outgrow it on the first
    forward pass (accelerate's own planner keeps the same room)."""
    plan = plan_auto(sizes, blocks, budgets)
    if "disk" not in plan.values():
        return plan
    largest = max(plan_units(sizes, blocks).values(), default=0)
    (main, room), rest = budgets[0], budgets[1:]
    if main == "disk" or room is None:
        return plan
    return plan_auto(sizes, blocks, [(main, max(0, room - largest)), *rest])


# --------------------------------------------------------------------------------------------
# Resolving a user's device_map against a model.
# --------------------------------------------------------------------------------------------


def no_split_names(model: nn.Module, classes: Iterable[str] | None = None) -> list[str]:
    """Names of the modules of ``model`` whose class is in ``classes`` (default: the union of
    ``_no_split_modules`` of the model and its submodules, as the model classes declare them)."""
    wanted = set(no_split_classes(model) if classes is None else classes)
    return [name for name, m in model.named_modules() if type(m).__name__ in wanted and name]


def tensor_sizes(model: nn.Module, itemsize: Mapping[str, int] | None = None) -> dict[str, int]:
    """Bytes of every tensor of ``model`` (meta tensors included), by name, in model order.

    A tensor held under several names (tied weights) is counted once, under its first name.
    ``itemsize`` overrides the element size of some tensors (the dtype they will be loaded in).
    """
    out: dict[str, int] = {}
    for group in group_slots(tensor_slots(model)):
        name, tensor = group[0].name, group[0].tensor
        size = (itemsize or {}).get(name, tensor.element_size())
        out[name] = tensor.numel() * size
    return out


def default_budgets(
    max_memory: Mapping[DeviceLike, int | str] | None = None,
) -> list[tuple[str, int | None]]:
    """``(device, bytes)`` in the order "auto" fills them.

    With ``max_memory``: those devices and budgets, GPUs first (in the given order), then the
    CPU if listed. Without: every CUDA device, most free memory first, with
    ``GPU_HEADROOM`` of its free memory, then the CPU with the memory this process may use: its
    cgroup's limit less what the cgroup holds, else ``MemAvailable``
    (:func:`fastload.core.memory.budget.memory_budget`; no limit where it cannot tell).
    """
    if max_memory is not None:
        if not isinstance(max_memory, Mapping):
            raise RequestError(f"max_memory must be a dict of device -> size, got {max_memory!r}")
        parsed = [
            (map_device(d, where="max_memory"), parse_bytes(b, where=f"max_memory[{d!r}]"))
            for d, b in max_memory.items()
        ]
        parsed.sort(key=lambda p: p[0].type == "cpu")  # stable: GPUs keep the user's order
        return [(str(d), b) for d, b in parsed]
    budgets: list[tuple[str, int | None]] = []
    if torch.cuda.is_available():
        free = [(torch.cuda.mem_get_info(i)[0], i) for i in range(torch.cuda.device_count())]
        free.sort(key=lambda f: -f[0])
        budgets += [(f"cuda:{i}", int(b * GPU_HEADROOM)) for b, i in free]
    budgets.append(("cpu", memory_budget().available))
    return budgets


#: device_map modes planned by accelerate's planner (when accelerate is installed)
ACCELERATE_MODES = ("balanced", "balanced_low_0", "sequential")


def resolve_device_map(
    device_map: DeviceMapArg,
    model: nn.Module,
    *,
    max_memory: Mapping[DeviceLike, int | str] | None = None,
    itemsize: Mapping[str, int] | None = None,
    no_split: Iterable[str] | None = None,
    disk: bool = False,
) -> DeviceMap:
    """Checks ``device_map`` against ``model`` (whose tensors may be on meta).

    ``"auto"`` is planned by :func:`plan_auto`; ``"balanced"``, ``"balanced_low_0"`` and
    ``"sequential"`` by accelerate's planner (``infer_auto_device_map``, with
    ``get_balanced_memory`` for the balanced modes). ``no_split`` names the
    module classes kept whole on one device (default: the model's ``_no_split_modules``).
    Raises ``RequestError`` for an unknown device, a prefix that names nothing in the model, a
    tensor no prefix covers, or an "auto" plan that does not fit; ``UnsupportedError`` for
    ``"disk"`` unless ``disk`` allows it (then the planners also spill to disk what does not fit
    elsewhere), or an accelerate mode without accelerate installed.
    """
    planned = isinstance(device_map, str) and device_map in ("auto", *ACCELERATE_MODES)
    if max_memory is not None and not planned:
        raise RequestError(
            f"max_memory only applies to device_map='auto' or one of {ACCELERATE_MODES}"
        )
    if isinstance(device_map, str) and device_map in ACCELERATE_MODES:
        return _accelerate_plan(device_map, model, max_memory, no_split, disk)
    if isinstance(device_map, str) and device_map == "auto":
        sizes = tensor_sizes(model, itemsize)
        blocks = no_split_names(model, None if no_split is None else list(no_split))
        budgets = default_budgets(max_memory) + ([("disk", None)] if disk else [])
        plan = _plan_with_disk(sizes, blocks, budgets)
        resolved = DeviceMap({k: map_device(v, disk=disk) for k, v in plan.items()})
        logger.info("device_map='auto': %s", resolved.as_strings())
        return resolved
    if isinstance(device_map, Mapping):
        if not device_map:
            raise RequestError("device_map is an empty dict")
        prefixes: dict[str, torch.device] = {}
        for prefix, device in device_map.items():
            if not isinstance(prefix, str):
                raise RequestError(f"device_map keys must be module names, got {prefix!r}")
            prefixes[prefix] = map_device(device, where=f"device_map[{prefix!r}]", disk=disk)
        resolved = DeviceMap(prefixes)
        _check_covers(resolved, model)
        return resolved
    if isinstance(device_map, (str, int, torch.device)):
        return DeviceMap({"": map_device(device_map)})
    raise RequestError(
        f"device_map must be 'auto', a device or a dict of module name -> device; "
        f"got {device_map!r}"
    )


def single_device(
    device_map: DeviceMapArg,
    *,
    max_memory: Mapping[DeviceLike, int | str] | None = None,
    disk: bool = False,
) -> torch.device | None:
    """The one device ``device_map`` places the whole model on, when that follows from the
    argument alone, before the model exists: a device; a dict whose entries all name one device;
    ``"auto"`` or an accelerate mode on a machine without an accelerator (``torch.accelerator``:
    CUDA, XPU, MPS ...), with no ``max_memory`` and no disk to spill to (every planner then
    puts everything on the CPU). ``None`` otherwise."""
    if isinstance(device_map, str) and device_map in ("auto", *ACCELERATE_MODES):
        return None if _accelerator() or max_memory is not None or disk else torch.device("cpu")
    if max_memory is not None:
        return None
    places = list(device_map.values()) if isinstance(device_map, Mapping) else [device_map]
    if not places or any(isinstance(p, str) and p.strip().lower() == "disk" for p in places):
        return None
    devices = {_indexed(parse_device(p, where="device_map")) for p in places}
    return devices.pop() if len(devices) == 1 else None


def _accelerator() -> bool:
    """Whether this machine has a device the planners would fill before the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def _indexed(device: torch.device) -> torch.device:
    """One spelling per device: ``cpu:0`` is ``cpu``, ``cuda`` the current CUDA device."""
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _accelerate_plan(
    mode: str,
    model: nn.Module,
    max_memory: Mapping[DeviceLike, int | str] | None,
    no_split: Iterable[str] | None,
    disk: bool,
) -> DeviceMap:
    try:
        from accelerate.utils import get_balanced_memory, infer_auto_device_map
    except ImportError:
        raise UnsupportedError(
            f"device_map={mode!r} is planned by accelerate, which is not installed "
            "(pip install accelerate); device_map='auto' uses fastload's own planner"
        ) from None
    classes = list(no_split) if no_split is not None else no_split_classes(model)
    budgets: dict[int | str, int | str] | None = None
    if max_memory is not None:
        # accelerate names CUDA devices by index
        budgets = {}
        for device, size in max_memory.items():
            dev = map_device(device, where="max_memory")
            key: int | str = (dev.index or 0) if dev.type == "cuda" else dev.type
            budgets[key] = size
    else:
        # accelerate sizes "cpu" from the host's free memory; in a container the limit is the
        # cgroup's (fastload.core.memory.budget)
        from accelerate.utils import get_max_memory

        budgets = dict(get_max_memory())
        cpu = memory_budget().available
        if cpu is not None:
            budgets["cpu"] = cpu
    if mode != "sequential":
        budgets = get_balanced_memory(
            model,
            max_memory=budgets,
            no_split_module_classes=classes,
            low_zero=mode == "balanced_low_0",
        )
    plan = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=classes)
    if not disk and any(str(d) == "disk" for d in plan.values()):
        raise UnsupportedError(
            f"device_map={mode!r}: the model does not fit in the GPUs and the CPU memory, and "
            "offloading to disk needs offload_folder=; or give more memory with max_memory"
        )
    resolved = DeviceMap({k: map_device(v, disk=disk) for k, v in plan.items()})
    logger.info("device_map=%r (accelerate): %s", mode, resolved.as_strings())
    return resolved


def no_split_classes(model: nn.Module) -> list[str]:
    """The union of ``_no_split_modules`` of ``model`` and its submodules."""
    found: set[str] = set()
    for module in model.modules():
        found.update(getattr(module, "_no_split_modules", None) or ())
    return sorted(found)


def _check_covers(device_map: DeviceMap, model: nn.Module) -> None:
    names = [s.name for s in tensor_slots(model)]
    known = set(names) | {name for name, _ in model.named_modules(remove_duplicate=False)}
    unknown = [p for p in device_map.prefixes if p not in known]
    if unknown:
        raise RequestError(
            f"device_map names {unknown!r}, which are neither modules nor tensors of "
            f"{type(model).__name__}"
        )
    uncovered = [n for n in names if not any(within(p, n) for p in device_map.prefixes)]
    if uncovered:
        shown = ", ".join(uncovered[:5]) + (" ..." if len(uncovered) > 5 else "")
        raise RequestError(
            f"device_map covers no device for {len(uncovered)} tensors of "
            f"{type(model).__name__}: {shown}; add them or a '' entry for the rest"
        )


def require_accelerate() -> None:
    """``UnsupportedError`` unless accelerate, whose hooks run offloaded modules, is installed."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise UnsupportedError(
            "offloading to disk runs the offloaded modules through accelerate's hooks; "
            "pip install accelerate"
        ) from None


def resolve_for_load(
    model: nn.Module,
    device_map: DeviceMapArg | None,
    *,
    offload_folder: str | os.PathLike[str] | None,
    max_memory: Mapping[DeviceLike, int | str] | None,
    no_split: Iterable[str] | None,
) -> DeviceMap | None:
    """A load's ``device_map`` resolved against ``model`` (``None`` without one); with an
    ``offload_folder``, disk is a place too: accelerate is required and the folder is made."""
    if device_map is None:
        return None
    disk = offload_folder is not None
    if disk:
        require_accelerate()
        try:
            os.makedirs(offload_folder, exist_ok=True)  # type: ignore[arg-type]
        except OSError as e:  # the same built-in class, naming the argument
            raise from_os_error(
                e, offload_folder, "offload_folder: cannot create the directory"
            ) from e
    return resolve_device_map(
        device_map, model, max_memory=max_memory, no_split=no_split, disk=disk
    )


__all__ = [
    "ACCELERATE_MODES",
    "GPU_HEADROOM",
    "default_budgets",
    "no_split_classes",
    "no_split_names",
    "plan_auto",
    "plan_units",
    "require_accelerate",
    "resolve_device_map",
    "resolve_for_load",
    "single_device",
    "tensor_sizes",
]
