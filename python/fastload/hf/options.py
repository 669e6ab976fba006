"""transformers' ``from_pretrained`` options, and what each means to fastload.

Every option of transformers 5's ``PreTrainedModel.from_pretrained`` (and of the Auto classes') is
in :data:`OPTIONS`: honoured with transformers' meaning, or refused with ``UnsupportedError``
naming it. An option passed with the value that means "not used" (``None``, ``False``, an empty
dict, transformers' default) is accepted whatever its row says: code written for transformers
passes such values routinely. Whatever is not an option is a config override or an ``__init__``
argument, as transformers decides (``config_class.from_pretrained(return_unused_kwargs=True)``).
The option table of docs/options.md is this one (tests/project/test_docs.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastload.core.basics.arguments import check_bool
from fastload.core.basics.errors import UnsupportedError

#: option -> ("honoured" | "refused", what fastload does)
OPTIONS: dict[str, tuple[str, str]] = {
    "config": ("honoured", "a config object, or a path/id to load it from"),
    "state_dict": ("honoured", "loads these tensors instead of files (with `config=`)"),
    "cache_dir": ("honoured", "the Hugging Face cache to resolve a model id in"),
    "force_download": ("honoured", "passed to huggingface_hub"),
    "local_files_only": ("honoured", "no network: the cache only (also `HF_HUB_OFFLINE=1`)"),
    "token": ("honoured", "passed to huggingface_hub"),
    "revision": ("honoured", "branch, tag or commit of a model id"),
    "subfolder": ("honoured", "the checkpoint lies in this folder of the repo or directory"),
    "variant": ("honoured", "loads `model.<variant>.safetensors` (or its sharded index)"),
    "use_safetensors": (
        "honoured",
        "True: safetensors only; False: the pickle checkpoint, read with "
        "torch.load(weights_only=True)",
    ),
    "weights_only": ("honoured", "True only: fastload never unpickles anything but tensors"),
    "ignore_mismatched_sizes": ("honoured", "re-initializes tensors of another shape"),
    "output_loading_info": ("honoured", "also returns the LoadReport (a dict in patch mode)"),
    "dtype": (
        "honoured",
        "'auto' as transformers (config dtype, then the checkpoint's; keep-fp32 modules); "
        "'stored' keeps stored dtypes; a float dtype converts during the copy",
    ),
    "torch_dtype": ("honoured", "alias of `dtype`"),
    "device_map": (
        "honoured",
        "a device, a dict, 'auto' (fastload's planner), 'balanced', 'balanced_low_0', "
        "'sequential' (accelerate's planner); each tensor is read onto its device",
    ),
    "max_memory": ("honoured", "device budgets; without device_map it implies 'auto'"),
    "key_mapping": ("honoured", "alias of `key_map`: {regex: replacement} on checkpoint names"),
    "low_cpu_mem_usage": ("honoured", "accepted: fastload always builds on meta and reads once"),
    "attn_implementation": ("honoured", "set on the config before the model is built"),
    "experts_implementation": ("honoured", "set on the config before the model is built"),
    "generation_config": ("honoured", "replaces the checkpoint's generation config"),
    "trust_remote_code": ("honoured", "runs the repo's `auto_map` code; refused without it"),
    "code_revision": ("honoured", "revision of the remote code"),
    "tp_plan": (
        "honoured",
        "'auto' (or any plan under the patch): transformers' DTensor tensor parallelism, each "
        "rank reading 1/N of the checkpoint; a fastload plan dict or 'llama': plain shards",
    ),
    "disable_mmap": (
        "honoured",
        "True: nothing mapped (mmap='copy', read_mode='pread'); False: read_mode='mmap'",
    ),
    "tqdm_class": ("honoured", "progress bar class of downloads"),
    "_from_auto": ("honoured", "internal to transformers; accepted"),
    "_from_pipeline": ("honoured", "internal to transformers; accepted"),
    "_commit_hash": ("honoured", "ignored, as transformers 5 ignores it"),
    "_fast_init": ("honoured", "ignored, as transformers 5 ignores it"),
    "offload_state_dict": ("honoured", "ignored, as transformers 5 ignores it"),
    "adapter_name": ("honoured", "'default' only (no PEFT adapter is loaded)"),
    "proxies": ("refused", "huggingface_hub no longer takes proxies; set HTTPS_PROXY"),
    "offload_folder": (
        "honoured",
        "allows 'disk' in device_map: those weights stay in the safetensors file and "
        "accelerate's hooks read them onto the execution device when used",
    ),
    "offload_buffers": ("refused", "buffers are never offloaded"),
    "quantization_config": (
        "refused",
        "no quantization on load (a pre-quantized checkpoint's own config is read, see "
        "Quantized checkpoints)",
    ),
    "gguf_file": ("refused", "GGUF files are not read"),
    "distributed_config": ("honoured", "tensor parallelism as transformers' (tp_size only)"),
    "device_mesh": ("honoured", "accepted and ignored, as transformers 5 ignores it"),
    "tp_size": ("honoured", "tensor parallelism over this many ranks, as transformers'"),
    "fusion_config": ("refused", "no module fusion"),
    "use_kernels": ("refused", "no hub kernels"),
    "kernel_config": ("refused", "no hub kernels"),
    "allow_all_kernels": ("refused", "no hub kernels"),
    "adapter_kwargs": ("refused", "no PEFT adapters"),
    "from_tf": ("refused", "TensorFlow checkpoints are not read"),
    "from_flax": ("refused", "Flax checkpoints are not read"),
    "mirror": ("refused", "removed from transformers"),
}

#: the value that means "not used", for options whose default is not None
_DEFAULTS: dict[str, Any] = {
    "weights_only": True,
    "adapter_name": "default",
    "subfolder": "",
    "revision": "main",
}

#: options that are the core loader's own, under the same name
_CORE = ("device_map", "max_memory", "tp_plan", "ignore_mismatched_sizes", "offload_folder")

HUB = ("cache_dir", "force_download", "local_files_only", "token", "revision", "tqdm_class")

#: the options that are flags in transformers (``None`` means "not used", as for every option)
FLAGS = (
    "force_download",
    "local_files_only",
    "use_safetensors",
    "weights_only",
    "ignore_mismatched_sizes",
    "output_loading_info",
    "low_cpu_mem_usage",
    "trust_remote_code",
    "disable_mmap",
    "_from_auto",
    "_fast_init",
    "offload_state_dict",
    "offload_buffers",
    "use_kernels",
    "allow_all_kernels",
    "from_tf",
    "from_flax",
)


def check_option_types(kwargs: dict[str, Any], *, where: str = "from_pretrained") -> None:
    """``TypeError`` naming the first flag of :data:`FLAGS` in ``kwargs`` that is neither
    ``True``, ``False`` nor ``None`` (``local_files_only="no"`` would be true).

    For fastload's own ``from_pretrained`` only: under :func:`fastload.hf.patch_transformers`,
    transformers' call shape applies, and transformers reads these flags by truthiness."""
    for name in FLAGS:
        if name in kwargs:
            check_bool(kwargs[name], name, where=where, optional=True)


def _unused(name: str, value: Any) -> bool:
    if name in _DEFAULTS:
        return bool(value == _DEFAULTS[name])
    if name in ("disable_mmap", "use_safetensors"):  # False means something
        return value is None
    return value is None or value is False or (isinstance(value, (dict, list)) and not value)


@dataclass
class HfOptions:
    """transformers' options of one call, sorted by who acts on them."""

    #: huggingface_hub arguments (revision, cache_dir...)
    hub: dict[str, Any] = field(default_factory=dict)
    subfolder: str = ""
    variant: str | None = None
    #: True: safetensors only; False: pickle; None: safetensors, pickle only if allowed
    use_safetensors: bool | None = None
    trust_remote_code: bool = False
    code_revision: str | None = None
    #: set on the config: attn_implementation, experts_implementation
    config_attrs: dict[str, Any] = field(default_factory=dict)
    generation_config: Any = None
    #: transformers' tensor-parallel options (tp_size, device_mesh, distributed_config)
    tp: dict[str, Any] = field(default_factory=dict)
    #: core loader options these map onto (dtype, key_map, read_mode, allow_pickle...)
    core: dict[str, Any] = field(default_factory=dict)


def split_options(kwargs: dict[str, Any]) -> HfOptions:
    """Takes transformers' options out of ``kwargs`` (left with config / ``__init__``
    arguments); ``UnsupportedError`` names the first option fastload cannot honour."""
    out = HfOptions()
    for name in [k for k in kwargs if k in OPTIONS and k not in ("config", "state_dict")]:
        value = kwargs.pop(name)
        status, why = OPTIONS[name]
        if _unused(name, value):
            continue
        if status == "refused":
            raise UnsupportedError(f"from_pretrained option {name}={value!r}: {why}")
        _honour(out, name, value)
    return out


def _honour(out: HfOptions, name: str, value: Any) -> None:
    core = out.core
    if name in HUB:
        out.hub[name] = value
    elif name == "subfolder":
        out.subfolder = str(value)
    elif name == "variant":
        out.variant = str(value)
    elif name == "use_safetensors":
        out.use_safetensors = bool(value)
        if value is False:
            core["allow_pickle"] = True
    elif name == "weights_only":
        raise UnsupportedError(
            f"from_pretrained option weights_only={value!r}: fastload reads pickles with "
            "weights_only=True only"
        )
    elif name in ("dtype", "torch_dtype"):
        core["dtype"] = value
    elif name == "key_mapping":
        core["key_map"] = value
    elif name in (
        "device_map",
        "max_memory",
        "tp_plan",
        "ignore_mismatched_sizes",
        "offload_folder",
    ):
        core[name] = value
    elif name == "disable_mmap":
        core["read_mode"] = "pread" if value else "mmap"
        if value:  # no mapping at all: copies, read with pread (the default maps local files)
            core["mmap"] = "copy"
    elif name in ("attn_implementation", "experts_implementation"):
        out.config_attrs[f"_{name}"] = value
    elif name in ("tp_size", "device_mesh", "distributed_config"):
        out.tp[name] = value
    elif name == "generation_config":
        out.generation_config = value
    elif name == "trust_remote_code":
        out.trust_remote_code = bool(value)
    elif name == "code_revision":
        out.code_revision = value
    elif name == "adapter_name":
        raise UnsupportedError(f"from_pretrained option adapter_name={value!r}: no PEFT adapters")
    # the rest (low_cpu_mem_usage, _from_auto, ...) need nothing


def counts() -> tuple[int, int]:
    """(honoured, refused) options."""
    honoured = sum(1 for status, _ in OPTIONS.values() if status == "honoured")
    return honoured, len(OPTIONS) - honoured


def markdown_table() -> str:
    """The option table of docs/options.md, in Markdown."""
    rows = ["| option | fastload |", "|---|---|"]
    for name, (status, why) in OPTIONS.items():
        mark = "" if status == "honoured" else "**refused** (`UnsupportedError`): "
        rows.append(f"| `{name}` | {mark}{why} |")
    return "\n".join(rows)
