"""Patch mode: diffusers' own ``ModelMixin.from_pretrained`` served by fastload, callers unchanged.

:func:`patch_diffusers` replaces ``diffusers.ModelMixin.from_pretrained``; every model class (a
UNet, a VAE, a diffusion transformer, and so a pipeline's model components) then loads through
:func:`fastload.diffusion.front.load_diffusers`; ``DiffusionPipeline.from_pretrained`` reads the
components' files in one pass (:mod:`fastload.diffusion.pipeline`). It also installs
:func:`fastload.patch_transformers` (a pipeline's text encoders are transformers models), and
undoes it with the patch if it installed it. A call fastload does not serve identically goes
whole to diffusers' own implementation, with one warning saying why: a quantization config,
disk offload or a ``device_map`` other than one device, ``low_cpu_mem_usage=False``,
``ignore_mismatched_sizes``, options fastload refuses (DDUF, FlashPack, context parallelism),
pickle weights, a folder without the weights asked for (diffusers then raises its own error).

What the caller gets is what diffusers returns: the model, or ``(model, loading_info)`` with
``output_loading_info=True``, ``loading_info`` the dict diffusers returns (``missing_keys``,
``unexpected_keys``, ``mismatched_keys``, ``error_msgs``); missing and unused tensors are warned in
diffusers' words on its logger. :data:`last_report` is the
:class:`~fastload.core.plan.report.LoadReport` of the latest call fastload served (``None`` when it
was left to diffusers, then :data:`last_fallback` says why).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import torch

from fastload.core.basics.errors import (
    CheckpointError,
    FastloadIOError,
    PickleRefusedError,
    UnsupportedError,
)
from fastload.core.plan.load_options import OPTION_NAMES, split_load_options
from fastload.core.plan.report import LoadReport
from fastload.diffusion import pipeline, reads, remote_pipeline
from fastload.diffusion.remote import is_remote
from fastload.hf.patch import Patch
from fastload.hf.remote_folders import lookup, not_served

__all__ = [
    "diffusers_patched",
    "last_fallback",
    "last_report",
    "patch_diffusers",
    "unpatch_diffusers",
]

logger = logging.getLogger("fastload")

_LOCK = threading.Lock()
_original: Any = None  # the classmethod object patched over, while patched
_transformers_installed = False  # whether patch_diffusers installed patch_transformers
#: the report of the latest patched call fastload served (``None``: left to diffusers, or raised)
last_report: LoadReport | None = None
#: why the latest patched call was left to diffusers' own loader (``None`` when fastload served it)
last_fallback: str | None = None

#: diffusers' options whose given value makes the call diffusers' own (see the module docstring)
_DIFFUSERS_ONLY = (
    "quantization_config",
    "dduf_entries",
    "use_flashpack",
    "parallel_config",
    "offload_folder",
    "offload_state_dict",
    "max_memory",
    "proxies",
    "from_flax",
    "ignore_mismatched_sizes",
)


#: fastload's options that diffusers' from_pretrained also takes, with the same meaning
_SHARED = ("dtype", "device_map", "max_memory", "offload_folder", "ignore_mismatched_sizes")


def diffusers_patched() -> bool:
    """Whether ``diffusers.ModelMixin.from_pretrained`` is fastload's."""
    return _original is not None


def patch_diffusers() -> Patch:
    """Routes ``diffusers.ModelMixin.from_pretrained`` through fastload (idempotent), and
    transformers' ``from_pretrained`` too (:func:`fastload.patch_transformers`)."""
    global _original, _transformers_installed
    from diffusers.models.modeling_utils import ModelMixin

    with _LOCK:
        if _original is not None:
            return Patch(installed=False, undo=unpatch_diffusers)
        _original = ModelMixin.__dict__["from_pretrained"]
        ModelMixin.from_pretrained = classmethod(_from_pretrained)  # type: ignore[assignment]
        pipeline.install()  # a pipeline's components read in one pass
        # a pipeline from a URL (fastload.diffusion.remote_pipeline): outside the one pass, which
        # it calls on the folder standing for the URL
        remote_pipeline.install()
        reads.install()  # adapter and single-file reads
    try:
        from fastload.hf.patch import patch_transformers

        _transformers_installed = patch_transformers().installed
    except ImportError:  # diffusers without transformers: its models only
        _transformers_installed = False
    return Patch(installed=True, undo=unpatch_diffusers)


def unpatch_diffusers() -> None:
    """Puts diffusers' own ``from_pretrained`` back (and transformers', if
    :func:`patch_diffusers` patched it); nothing happens if it is not patched."""
    global _original, _transformers_installed
    from diffusers.models.modeling_utils import ModelMixin

    with _LOCK:
        if _original is None:
            return
        ModelMixin.from_pretrained = _original  # type: ignore[method-assign]
        _original = None
        remote_pipeline.uninstall()  # the outer one first
        pipeline.uninstall()
        reads.uninstall()
    if _transformers_installed:
        from fastload.hf.patch import unpatch_transformers

        unpatch_transformers()
        _transformers_installed = False


def _diffusers_own(cls: type, name: Any, kwargs: dict[str, Any]) -> Any:
    original = _original
    if original is None:  # unpatched meanwhile: the class's own method is diffusers'
        return cls.from_pretrained(name, **kwargs)  # type: ignore[attr-defined]
    return original.__func__(cls, name, **kwargs)


def _not_served(cls: type, name: Any, kwargs: dict[str, Any]) -> str | None:
    """Why diffusers' own loader must serve this call (``None``: fastload serves it)."""
    if name is None or not isinstance(name, (str, os.PathLike)):
        return "no model name or path"
    given = [k for k in _DIFFUSERS_ONLY if kwargs.get(k) not in (None, False, {})]
    if given:
        return f"{given[0]}={kwargs[given[0]]!r}"
    if kwargs.get("low_cpu_mem_usage") is False:
        return "low_cpu_mem_usage=False"
    if kwargs.get("use_safetensors") is False:
        return "use_safetensors=False (pickle weights)"
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is not None and (
        not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2
    ):
        return f"dtype={dtype!r}"
    device_map = kwargs.get("device_map")
    if device_map is not None and _one_device(device_map) is None:
        return f"device_map={device_map!r} (fastload serves one device under the patch)"
    # a URL's own options: where to read it, and which ranks read it together
    shared = set(_SHARED) | ({"storage_options", "process_group"} if is_remote(name) else set())
    fastload_only = sorted(set(kwargs) & set(OPTION_NAMES) - shared)
    if fastload_only:  # to diffusers, a config or __init__ argument
        return f"{fastload_only[0]}= (not an option of diffusers)"
    return None


def _one_device(device_map: Any) -> torch.device | None:
    """The one device a diffusers ``device_map`` names (a device, an index, ``{"": device}``)."""
    if isinstance(device_map, dict):
        if set(device_map) != {""}:
            return None
        device_map = device_map[""]
    if isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0"):
        return None
    if isinstance(device_map, str) and device_map in ("sequential", "disk"):
        return None
    try:
        return torch.device(device_map)
    except (RuntimeError, TypeError):
        return None


def _files_served(cls: type, name: Any, kwargs: dict[str, Any]) -> str | None:
    """Why the folder's files are diffusers' to read (``None``: fastload reads them): weights
    that are not there (diffusers raises its own error), pickle weights, a quantized config."""
    from fastload.diffusion import files as filesmod
    from fastload.diffusion.options import split_options

    if is_remote(name):  # read from object storage: what is not served is said by the load
        return None
    try:
        opts = split_options({k: v for k, v in kwargs.items() if k in _FILE_OPTIONS})
        found = filesmod.resolve(
            name,
            hub=opts.hub,
            subfolder=opts.subfolder,
            variant=opts.variant,
            use_safetensors=opts.use_safetensors,
        )
    except (CheckpointError, FastloadIOError, UnsupportedError) as e:
        return str(e)
    if not found.weights.name.endswith((".safetensors", ".json")):
        return f"{found.weights.name}: pickle weights"
    try:
        config = json.loads((found.folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{found.folder / 'config.json'}: {e}"
    if isinstance(config, dict) and config.get("quantization_config") is not None:
        return "a quantized model (quantization_config in its config)"
    return None


_FILE_OPTIONS = (
    "subfolder",
    "variant",
    "use_safetensors",
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
)


def _from_pretrained(cls: type, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:
    global last_report, last_fallback
    last_report, last_fallback = None, None
    name = pretrained_model_name_or_path
    reason = _not_served(cls, name, kwargs) or _files_served(cls, name, kwargs)
    if reason is None:
        from fastload.diffusion.front import load_diffusers

        options = dict(kwargs)
        info = bool(options.pop("output_loading_info", False))
        device_map = options.pop("device_map", None)
        if device_map is not None:
            options["device"] = _one_device(device_map)
        if options.get("dtype") is None:
            options.pop("dtype", None)
        given, rest = split_load_options(options)
        try:
            model, report = load_diffusers(
                cls, name, config=None, state_dict=None, given=given, kwargs=rest
            )
        except (UnsupportedError, PickleRefusedError) as e:
            reason = str(e)
        else:
            last_report = report
            logger.info("fastload served %s.from_pretrained(%r)", cls.__name__, name)
            if not info:
                return model
            return model, _loading_info(report)
    remote = lookup(name)
    if remote is not None:  # a pipeline's component: its folder has no weights
        raise not_served(cls, remote, reason, "diffusers")
    if is_remote(name):  # diffusers' own loader cannot read object storage
        raise UnsupportedError(f"{cls.__name__}.from_pretrained({name!r}): {reason}")
    logger.warning(
        "fastload: %s.from_pretrained(%r) is left to diffusers: %s", cls.__name__, name, reason
    )
    last_fallback = reason
    return _diffusers_own(cls, name, kwargs)


def _loading_info(report: LoadReport) -> dict[str, list[Any]]:
    """diffusers' ``loading_info``: lists of missing, unexpected and mismatched names."""
    return {
        "missing_keys": list(report.missing),
        "unexpected_keys": list(report.unexpected),
        "mismatched_keys": [(n, torch.Size(c), torch.Size(m)) for n, c, m in report.mismatched],
        "error_msgs": [],
    }
