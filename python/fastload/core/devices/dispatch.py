"""Running a model whose modules a device map spread over several devices: each module's inputs
go to its weights, the model's outputs come back where its inputs were (as accelerate's hooks do,
without accelerate). A map with disk entries runs through accelerate's own hooks instead
(:mod:`fastload.core.reads.offload`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fastload.core.devices.device_map import DeviceMap


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        # Non-blocking only towards an accelerator: a non-blocking copy to the CPU returns before
        # the data has arrived.
        if value.device == device or value.device.type == "meta":
            return value  # a meta tensor has no data to move (a module left on meta computes on it)
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_move(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def _own_device(module: nn.Module) -> torch.device | None:
    """The device of the first tensor ``module`` holds itself (not its children's)."""
    for tensor in module.parameters(recurse=False):
        return tensor.device
    for tensor in module.buffers(recurse=False):
        return tensor.device
    return None


def _weights_device(module: nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


def dispatch(model: nn.Module, device_map: DeviceMap) -> list[Any]:
    """Lets a model whose modules live on several devices run, as accelerate's hooks do: before
    each mapped module and each module holding tensors of its own runs, its tensor inputs are
    moved to the device of its weights (tied weights decide for themselves, wherever the map put
    the canonical copy), and the model's outputs come back on the device its inputs came from.
    Returns the hook handles.

    A module under a mapped prefix that computes with its own weights needs its own hook: a
    final norm mapped with the rest to the CPU runs on what the last GPU layer returned.
    Nothing is registered when the map uses a single device.
    """
    if len(device_map.devices) <= 1:
        return []
    targets: dict[int, tuple[nn.Module, torch.device]] = {}
    for prefix in device_map.prefixes:
        try:
            module = model.get_submodule(prefix) if prefix else model
        except AttributeError:
            continue  # a prefix naming a tensor: its module's own prefix decides
        device = _weights_device(module)
        if device is not None:
            targets[id(module)] = (module, device)
    for module in model.modules():
        device = _own_device(module)
        if device is not None:
            targets[id(module)] = (module, device)
    handles = []
    for module, device in targets.values():

        def move_inputs(
            _module: nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            device: torch.device = device,
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return _move(args, device), _move(kwargs, device)

        handles.append(module.register_forward_pre_hook(move_inputs, with_kwargs=True))
    handles += _outputs_where_inputs_were(model)
    return handles


def _outputs_where_inputs_were(model: nn.Module) -> list[Any]:
    """Hooks that give ``model``'s outputs back on the device of its first tensor input
    (accelerate's ``io_same_device`` on the root): logits of a model whose head is on a GPU come
    back where the caller's ``input_ids`` are. Registered first, so it sees the caller's inputs."""
    seen: list[torch.device] = []

    def remember(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.clear()
        first = _first_tensor((args, kwargs))
        if first is not None:
            seen.append(first.device)

    def give_back(_module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> Any:
        return _move_in_place(output, seen[0]) if seen else output

    return [
        model.register_forward_pre_hook(remember, with_kwargs=True, prepend=True),
        model.register_forward_hook(give_back, with_kwargs=True),
    ]


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value
    if isinstance(value, (dict, list, tuple)):
        for v in items:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def _move_in_place(value: Any, device: torch.device) -> Any:
    """As :func:`_move`, keeping a mapping's own type (a model's output class) by setting
    its items rather than building a plain dict."""
    if isinstance(value, dict):
        for k, v in list(value.items()):
            value[k] = _move_in_place(v, device)
        return value
    return _move(value, device)


__all__ = ["dispatch"]
