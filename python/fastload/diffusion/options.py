"""diffusers' ``ModelMixin.from_pretrained`` options, and what each means to fastload.

Every option diffusers 0.40's ``ModelMixin.from_pretrained`` takes is in :data:`OPTIONS`: honoured
with diffusers' meaning, or refused with ``UnsupportedError`` naming it. An option passed with the
value that means "not used" (``None``, ``False``, an empty dict) is accepted whatever its row says.
Options that fastload's own ``from_pretrained`` takes under the same name and meaning
(``dtype``, ``device_map``, ``max_memory``, ``offload_folder``, ``ignore_mismatched_sizes``,
``output_loading_info``) are fastload's (:mod:`fastload.core.plan.load_options`). Whatever is not an
option is a config override or an ``__init__`` argument, as diffusers decides
(``cls.load_config(..., return_unused_kwargs=True)``, then ``cls.from_config``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastload.core.basics.errors import UnsupportedError

__all__ = ["OPTIONS", "DiffusersOptions", "split_options"]

#: option -> ("honoured" | "refused", what fastload does)
OPTIONS: dict[str, tuple[str, str]] = {
    "cache_dir": ("honoured", "the Hugging Face cache to resolve a model id in"),
    "force_download": ("honoured", "passed to huggingface_hub"),
    "local_files_only": ("honoured", "no network: the cache only (also `HF_HUB_OFFLINE=1`)"),
    "token": ("honoured", "passed to huggingface_hub"),
    "revision": ("honoured", "branch, tag or commit of a model id"),
    "subfolder": ("honoured", "the model lies in this folder (`unet`, `vae`, `transformer`)"),
    "variant": ("honoured", "loads `diffusion_pytorch_model.<variant>.safetensors` or its index"),
    "use_safetensors": ("honoured", "True: safetensors only; False: the pickle weights"),
    "torch_dtype": ("honoured", "alias of `dtype` (`dtype` wins when both are given)"),
    "low_cpu_mem_usage": ("honoured", "accepted: fastload always builds on meta and reads once"),
    "offload_state_dict": ("honoured", "accepted: fastload never holds a whole state dict"),
    "disable_mmap": ("honoured", "True: every tensor a private copy (`mmap='copy'`)"),
    "mirror": ("honoured", "ignored, as diffusers ignores it"),
    "proxies": ("refused", "huggingface_hub no longer takes proxies; set HTTPS_PROXY"),
    "quantization_config": ("refused", "diffusers' quantizers: load it with diffusers"),
    "dduf_entries": ("refused", "DDUF archives: load them with diffusers"),
    "parallel_config": ("refused", "diffusers' context parallelism: load it with diffusers"),
    "use_flashpack": ("refused", "FlashPack files: load them with diffusers"),
    "flashpack_kwargs": ("refused", "FlashPack files: load them with diffusers"),
    "from_flax": ("refused", "Flax weights: diffusers 0.40 no longer reads them either"),
}

_HUB = ("cache_dir", "force_download", "local_files_only", "token", "revision")


@dataclass
class DiffusersOptions:
    """diffusers' options of one call, sorted out."""

    #: huggingface_hub arguments (revision, cache_dir...)
    hub: dict[str, Any] = field(default_factory=dict)
    subfolder: str = ""
    variant: str | None = None
    use_safetensors: bool | None = None
    #: fastload options they map onto (``torch_dtype`` -> ``dtype``, ``disable_mmap`` -> ``mmap``)
    core: dict[str, Any] = field(default_factory=dict)


def _unused(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (dict, list)) and not value)


def split_options(kwargs: dict[str, Any]) -> DiffusersOptions:
    """Takes diffusers' options out of ``kwargs`` (what is left is for the config), or raises
    ``UnsupportedError`` naming an option fastload does not serve."""
    out = DiffusersOptions()
    for name in [n for n in kwargs if n in OPTIONS]:
        value = kwargs.pop(name)
        if name == "use_safetensors" and value is not None:
            out.use_safetensors = bool(value)  # False is a choice here: the pickle weights
            continue
        if _unused(value):
            continue
        status, why = OPTIONS[name]
        if status == "refused":
            raise UnsupportedError(f"{name}={value!r}: not served by fastload ({why})")
        if name in _HUB:
            out.hub[name] = value
        elif name == "subfolder":
            if not isinstance(value, str):
                raise TypeError(f"subfolder must be a str, got {type(value).__name__}")
            out.subfolder = value
        elif name == "variant":
            if not isinstance(value, str):
                raise TypeError(f"variant must be a str, got {type(value).__name__}")
            out.variant = value
        elif name == "torch_dtype":
            out.core["dtype"] = value
        elif name == "disable_mmap":
            out.core["mmap"] = "copy"
    return out
