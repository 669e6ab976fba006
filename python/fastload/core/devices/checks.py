"""Checking the ``device`` argument of every public entry point before anything is read.

torch accepts many spellings (``"cuda:1"``, ``1``, ``torch.device("cpu")``) and fails late and
obscurely on the rest (``"Torch not compiled with CUDA enabled"`` after the file was opened, an
``AttributeError`` for a wrong type). Here every spelling is parsed once, and a device that cannot
be used in this process is refused with a fastload error that says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fastload.core.basics.errors import RequestError, UnsupportedError

DeviceArg = str | int | torch.device


def parse_device(device: DeviceArg, *, where: str = "", allow_meta: bool = False) -> torch.device:
    """``device`` as a usable :class:`torch.device`.

    Accepts what safetensors and torch accept: a ``torch.device``, a string (``"cpu"``,
    ``"cuda"``, ``"cuda:1"``, ``"mps"`` ...) or an int (an accelerator index, as torch reads it).
    This is the one parser of devices: ``device=`` of every entry point, and each device of a
    ``device_map`` or ``max_memory`` (:mod:`fastload.core.devices.device_map`, which adds
    ``"disk"``).

    Raises:
        TypeError: ``device`` is of another type (a bool, a float, None ...).
        RequestError: a string torch cannot parse, a device that does not exist (``"cpu:1"``, a
            CUDA index past the device count, ``"cuda"`` without CUDA), or ``"meta"`` where data
            must be read (``allow_meta`` lets a caller that only builds skeletons accept it).
        UnsupportedError: another backend this process cannot use (``"mps"`` off Apple silicon,
            ``"xpu"`` without one ...).
    """
    prefix = f"{where}: " if where else ""
    if isinstance(device, bool) or not isinstance(device, str | int | torch.device):
        raise TypeError(
            f"{prefix}device must be a str, an int or a torch.device, got {type(device).__name__} "
            f"{device!r}"
        )
    if isinstance(device, int) and not 0 <= device < 128:
        # torch keeps device indices in a signed byte: 4096 would silently become device 0.
        raise RequestError(f"{prefix}device index {device} is out of range")
    if isinstance(device, torch.device):
        parsed = device
    else:
        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError) as exc:
            raise RequestError(
                f"{prefix}device {device!r} is not a device torch knows ({exc})"
            ) from None
    if parsed.type == "meta":
        if allow_meta:
            return parsed
        raise RequestError(
            f"{prefix}device 'meta' holds no data, so nothing can be loaded onto it; build the "
            "model on meta yourself if you want a skeleton"
        )
    if parsed.type == "cpu":
        if parsed.index not in (None, 0):
            # torch parses "cpu:1", but there is one CPU device: the index would be ignored.
            raise RequestError(
                f"{prefix}device {str(parsed)!r} does not exist: the CPU is one device "
                "('cpu' or 'cpu:0')"
            )
        return parsed
    if parsed.type == "cuda":
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
        if (parsed.index or 0) >= count:  # "cuda" is the current device, which needs one
            has = (
                f"this machine has {count} CUDA device(s)" if available else "CUDA is not available"
            )
            raise RequestError(f"{prefix}device {str(parsed)!r} does not exist ({has})")
    why = _unusable(parsed)
    if why is not None:
        raise UnsupportedError(f"{prefix}device {str(parsed)!r} is not usable here: {why}")
    return parsed


def _unusable(device: torch.device) -> str | None:
    """Why ``device`` cannot hold tensors in this process, or ``None``."""
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available (torch.backends.mps.is_available() is False)"
    try:
        # The one test that holds for every backend (xpu, hpu, ...): allocate nothing there.
        torch.empty(0, device=device)
    except Exception as exc:  # torch raises RuntimeError, AssertionError ... per backend
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


__all__ = ["DeviceArg", "ambient_device", "cpu_by_default", "parse_device"]


def ambient_device() -> torch.device | None:
    """The device torch's factory functions allocate on by default here, when it is not the CPU:
    an enclosing ``with torch.device(...)`` block, or ``torch.set_default_device(...)``; ``None``
    when they allocate on the CPU."""
    device = torch.empty(0).device  # what a factory call without device= gets, contexts included
    return None if device.type == "cpu" else device


@contextlib.contextmanager
def cpu_by_default() -> Iterator[None]:
    """Factory calls without ``device=`` allocate on the CPU inside the block, whatever the
    caller's ambient device (:func:`ambient_device`) is; nothing is entered when it is already
    the CPU (a device context intercepts every torch call)."""
    if ambient_device() is None:
        yield
        return
    with torch.device("cpu"):
        yield
