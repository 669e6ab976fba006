"""Disk offload: parameters a device map sends to ``"disk"`` stay in the checkpoint file.

They are neither allocated nor read at load time; they stay on ``meta`` in the model, and
accelerate's offload hooks (``dispatch_model`` with an ``offload_index`` naming each one's
safetensors file and stored name) read them onto the execution device when their module runs:
the first GPU of the map, or the CPU when there is none. Where the load may map the file
(``mmap``), a tensor stored in its load dtype is served as a view of the mapping: its bytes stay
page cache, which the kernel can drop again, instead of a fresh allocation each time its module
runs (which glibc may keep after it is freed). Parameters under a disk prefix that the checkpoint
lacks (initialized) or that a module passed in already holds are served from memory instead. Only
safetensors files can be offloaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from fastload import _core
from fastload.core.basics.errors import UnsupportedError
from fastload.core.checkpoint.opened import OpenCheckpoint
from fastload.core.devices.device_map import DISK, DeviceMap
from fastload.core.memory.sharing import SharedMapping, file_sharing
from fastload.core.model.keys import within
from fastload.core.plan.actions import Action
from fastload.core.plan.load_plan import Group
from fastload.core.reads.reading import read_tensor


def offloaded_names(groups: Iterable[Group]) -> set[str]:
    """Model names left on ``meta`` because they are offloaded to disk."""
    return {
        n
        for g in groups
        if g.action == Action.LOAD and g.dest is not None and g.dest.device == DISK
        for n in g.names
    }


def dispatch_offloaded(
    model: nn.Module,
    device_map: DeviceMap,
    groups: list[Group],
    ckpt: OpenCheckpoint,
    *,
    mmap: str = "auto",
) -> None:
    """Attaches accelerate's hooks so the model runs with its disk-mapped parameters read from
    the checkpoint files when needed (as views of a mapping where ``mmap`` lets the file be
    mapped, :func:`fastload.core.memory.sharing.file_sharing`)."""
    from accelerate import dispatch_model
    from accelerate.utils import extract_submodules_state_dict

    disk_tensors: dict[str, tuple[_core.SafetensorsFile, str, torch.dtype]] = {}
    for group in groups:
        if group.action != Action.LOAD or group.dest is None or group.dest.device != DISK:
            continue
        stored, dest = group.sources[0].stored, group.sources[0].dest
        file = ckpt.files[stored.file]
        if not isinstance(file, _core.SafetensorsFile):
            raise UnsupportedError(
                f"{getattr(file, 'path', '<memory>')}: only safetensors files can be offloaded to "
                f"disk; tensor {stored.name!r} is in a pickle or an in-memory state dict"
            )
        for name in group.names:
            disk_tensors[name] = (file, stored.name, dest.dtype)
    accel_map = _flat_map(model, device_map)
    disk = [p for p, d in device_map.prefixes.items() if d == DISK]
    gpus = [d for d in device_map.devices if d.type not in ("cpu", "disk")]
    # accelerate compares the main device with the string "cpu": give it its own spelling
    main: int | str = "cpu"
    if gpus:
        main = (gpus[0].index or 0) if gpus[0].type == "cuda" else str(gpus[0])
    # What the hooks must serve from memory: disk-mapped tensors that are not in the file, and,
    # with a GPU executing them, the CPU-mapped modules (accelerate offloads those too).
    memory: dict[str, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        under_disk = any(within(p, name) for p in disk)
        if under_disk and name not in disk_tensors and tensor.device.type != "meta":
            memory[name] = tensor
    if main != "cpu":
        cpu = [p for p, d in device_map.prefixes.items() if d.type == "cpu"]
        memory.update(extract_submodules_state_dict(model.state_dict(), cpu))
    # The offloaded tensors are served as accelerate's "state dict", which its weights map asks
    # first: read from the files this load opened and validated, not reopened by path (a
    # checkpoint published anew into the same directory, or a chdir, would change what they read).
    # The index names them only because dispatch_model wants one for disk entries.
    dispatch_model(
        model,
        device_map=accel_map,
        main_device=main,
        state_dict=OffloadedTensors(memory, disk_tensors, mmap=mmap),
        offload_index={name: {} for name in disk_tensors},
        offload_buffers=False,
    )


class OffloadedTensors(Mapping[str, torch.Tensor]):
    """The tensors accelerate's offload hooks fetch when a module runs: ``memory`` as they are,
    and each disk-offloaded name anew (on the CPU, in its load dtype) from the open file the
    load validated: a view of its mapping where ``mmap`` allows one and the dtype is stored,
    else read."""

    def __init__(
        self,
        memory: dict[str, torch.Tensor],
        disk: dict[str, tuple[_core.SafetensorsFile, str, torch.dtype]],
        *,
        mmap: str = "auto",
    ) -> None:
        self._memory = memory
        self._disk = disk
        self._mmap = mmap
        # by file: its mapping, or None where the file is read instead
        self._mappings: dict[int, SharedMapping | None] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._memory:
            return self._memory[name]
        file, stored, dtype = self._disk[name]
        mapping = self._mapping(file)
        view = None if mapping is None else mapping.view(stored, dtype, track=False)
        if view is not None:
            return view
        return read_tensor(file, stored, device=torch.device("cpu"), dtype=dtype)

    def _mapping(self, file: _core.SafetensorsFile) -> SharedMapping | None:
        key = id(file)  # the files stay open (and alive) in the load's checkpoint
        if key not in self._mappings:
            shared, _ = file_sharing(file, self._mmap)
            self._mappings[key] = SharedMapping(file) if shared else None
        return self._mappings[key]

    def __contains__(self, name: object) -> bool:  # without reading (Mapping's would read)
        return name in self._memory or name in self._disk

    def __iter__(self) -> Iterator[str]:
        yield from self._memory
        yield from (n for n in self._disk if n not in self._memory)

    def __len__(self) -> int:
        return len(self._memory) + sum(n not in self._memory for n in self._disk)


def _flat_map(model: nn.Module, device_map: DeviceMap) -> dict[str, int | str]:
    """The map in accelerate's form, with no entry containing a more specific one: accelerate
    places a whole module per entry (``{"": "cpu", "layers.1": "disk"}`` would load layer 1 with
    the rest), so such an entry is split into its children."""
    by_name = device_map.accelerate_map()
    prefixes = list(device_map.prefixes)
    out: dict[str, int | str] = {}

    def visit(name: str, module: nn.Module) -> None:
        if not any(p != name and within(name, p) for p in prefixes):
            out[name] = by_name[_longest(prefixes, name)]
            return
        for attr in [*module._parameters, *module._buffers]:
            full = f"{name}.{attr}" if name else attr
            out[full] = by_name[_longest(prefixes, full)]
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return out


def _longest(prefixes: list[str], name: str) -> str:
    best = max(
        (p for p in prefixes if within(p, name)),
        key=len,
        default=None,
    )
    if best is None:
        raise UnsupportedError(f"device_map: no entry covers {name!r}")
    return best
