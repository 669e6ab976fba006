"""The reads of diffusers' adapter and single-file loaders, served by fastload under the patch.

LoRA (``diffusers.loaders.lora_base``), textual inversion (``textual_inversion``) and the UNet's
attention processors and adapters (``unet``) read a safetensors file with
``safetensors.torch.load_file(file, device="cpu")``; IP-adapter (``ip_adapter``) with
``safe_open(file, framework="pt", device="cpu")``; ``from_single_file``
(``single_file_utils.load_single_file_checkpoint``) with diffusers' ``load_state_dict``. Each
name is looked up in its module when called, so the patch rebinds it there, and only there:
safetensors itself, and diffusers' own model loader (where the patch hands a load to diffusers
whole), are left alone.

* ``load_file`` becomes :func:`fastload.load_file`: the tensors read in parallel by the engine,
  each into memory of its own (a network disk is read with large parallel reads, not page by
  page through a mapping);
* ``safe_open`` becomes :func:`fastload.safe_open`;
* single files: a ``.safetensors`` file read to the CPU goes to :func:`fastload.load_file`; any
  other (pickle, GGUF, another ``map_location``, an in-memory dict) to diffusers' own.

What fastload refuses (a file it finds malformed, for instance) is read by what diffusers called,
so diffusers' own errors and fallbacks (``allow_pickle``: a safetensors error, then the pickle
file) stay as they are.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from typing import Any

import torch

from fastload.core.basics.errors import FastloadError

__all__ = ["install", "uninstall"]

logger = logging.getLogger("fastload")

#: diffusers modules that call ``safetensors.torch.load_file`` through their ``safetensors`` name
_LOAD_FILE_MODULES = (
    "diffusers.loaders.lora_base",
    "diffusers.loaders.textual_inversion",
    "diffusers.loaders.unet",
)

#: (module, name) -> the object the patch replaced, while patched
_replaced: dict[tuple[str, str], Any] = {}


def _cpu(device: Any) -> bool:
    return device is None or (isinstance(device, (str, torch.device)) and str(device) == "cpu")


def _load_file(original: Callable[..., Any]) -> Callable[..., Any]:
    """``safetensors.torch.load_file`` served by fastload (a file fastload refuses, or a device
    other than the CPU, by ``original``)."""

    def load_file(filename: Any, device: Any = "cpu") -> dict[str, torch.Tensor]:
        if _cpu(device) and isinstance(filename, (str, os.PathLike)):
            from fastload.safetensors.files import load_file as fastload_load_file

            try:
                tensors = fastload_load_file(filename)
            except FastloadError as e:
                logger.info("fastload: %s read by safetensors (%s)", os.fspath(filename), e)
            else:
                logger.debug("fastload read %s for diffusers", os.fspath(filename))
                return tensors
        return original(filename, device=device)  # type: ignore[no-any-return]

    return load_file


def _load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' ``load_state_dict`` with a safetensors file read to the CPU served by
    fastload; everything else is diffusers' own."""
    load_file = _load_file(lambda f, device: original(f, map_location=device))

    def load_state_dict(
        checkpoint_file: Any, disable_mmap: bool = False, map_location: Any = "cpu"
    ) -> Any:
        if (
            isinstance(checkpoint_file, (str, os.PathLike))
            and os.fspath(checkpoint_file).endswith(".safetensors")
            and _cpu(map_location)
        ):
            # disable_mmap asks for memory of the dict's own: fastload's reads give that anyway
            return load_file(checkpoint_file, device="cpu")
        return original(checkpoint_file, disable_mmap=disable_mmap, map_location=map_location)

    return load_state_dict


def _safetensors_proxy(real: types.ModuleType) -> types.ModuleType:
    """A stand-in for the ``safetensors`` module whose ``torch.load_file`` is fastload's; every
    other name (``SafetensorError``, ``safe_open``...) is safetensors' own."""
    torch_api = types.ModuleType("safetensors.torch")
    torch_api.__dict__.update(real.torch.__dict__)
    torch_api.load_file = _load_file(real.torch.load_file)  # type: ignore[attr-defined]
    proxy = types.ModuleType("safetensors")
    proxy.__dict__.update(real.__dict__)
    proxy.torch = torch_api  # type: ignore[attr-defined]
    return proxy


def install() -> None:
    """Rebinds the adapter and single-file loaders' reads (the caller holds the patch's lock)."""
    import importlib

    import safetensors.torch  # noqa: F401 - the proxy copies its names

    import safetensors
    from fastload.safetensors.files import safe_open

    if _replaced:
        return
    targets: list[tuple[str, str, Any]] = [
        (name, "safetensors", _safetensors_proxy(safetensors)) for name in _LOAD_FILE_MODULES
    ]
    targets.append(("diffusers.loaders.ip_adapter", "safe_open", safe_open))
    single = "diffusers.loaders.single_file_utils"
    for module_name, attr, value in targets + [(single, "load_state_dict", None)]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a diffusers without this loader (or without its dependencies)
            continue
        if not hasattr(module, attr):
            continue
        original = getattr(module, attr)
        if value is None:
            value = _load_state_dict(original)
        _replaced[(module_name, attr)] = original
        setattr(module, attr, value)


def uninstall() -> None:
    """Puts every name :func:`install` rebound back."""
    import sys

    for (module_name, attr), original in _replaced.items():
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(module, attr, original)
    _replaced.clear()
