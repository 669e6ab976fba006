"""What transformers' ``from_pretrained`` reads from its surroundings, and what fastload does.

Under the patch (:mod:`fastload.hf.patch`) transformers' contract covers more than the call's
arguments:

* the **ambient device** (``with torch.device(...)`` or ``torch.set_default_device(...)``), when
  no ``device_map`` is given: the model is loaded there, and on ``meta`` transformers refuses
  with a ``RuntimeError`` (:func:`ambient_core_options`);
* the **environment**: ``HF_DEACTIVATE_ASYNC_LOAD`` true makes transformers load on the calling
  thread alone; fastload then starts no read-ahead thread and copies on the calling thread
  (:func:`ambient_core_options`);
* a **quantization config** (in config.json, or passed on the config): its method is named by
  :func:`quantization_method`; :mod:`fastload.hf.quantized` drives transformers' quantizer for
  the methods fastload reads and refuses the others, which under the patch go to transformers'
  own loader.

fastload's direct API (``fastload.from_pretrained``) takes its device from ``device=`` /
``device_map=`` only; the ambient device never leaks into a load
(:func:`fastload.core.devices.checks.cpu_by_default`).
"""

from __future__ import annotations

import os
from typing import Any

from fastload.core.devices.checks import ambient_device

#: transformers' words (``check_and_set_device_map``) for a load under an ambient meta device
META_CONTEXT_MESSAGE = (
    "You are using `from_pretrained` with a meta device context manager or "
    "`torch.set_default_device('meta')`.\nThis is an anti-pattern as `from_pretrained` wants to "
    "load existing weights.\nIf you want to initialize an empty model on the meta device, use the "
    "context manager or global device with `from_config`, or `ModelClass(config)`"
)

#: the environment variable that makes transformers load without threads
ASYNC_LOAD_OFF = "HF_DEACTIVATE_ASYNC_LOAD"


def env_true(name: str) -> bool:
    """Whether the environment variable ``name`` is true as transformers reads it
    (``is_env_variable_true``: true, 1, y, yes, on; any case)."""
    return os.getenv(name, "false").lower() in ("true", "1", "y", "yes", "on")


def ambient_core_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The core loader options transformers' surroundings ask for in a patched call with
    transformers' keyword arguments ``kwargs``: ``device`` from the ambient device (without a
    ``device_map``), ``read_ahead=False, threads=1`` under ``HF_DEACTIVATE_ASYNC_LOAD``.

    Raises:
        RuntimeError: the ambient device is ``meta``, with transformers' message.
    """
    core: dict[str, Any] = {}
    if kwargs.get("device_map") is None:
        device = ambient_device()
        if device is not None and device.type == "meta":
            raise RuntimeError(META_CONTEXT_MESSAGE)
        if device is not None:
            core["device"] = device
    if env_true(ASYNC_LOAD_OFF):
        core["read_ahead"] = False
        core["threads"] = 1
    return core


def quantization_method(config: Any) -> str | None:
    """The ``quant_method`` of ``config``'s quantization config (``"?"`` when it names none);
    ``None`` when the config has no quantization config."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method) if method is not None else "?"
