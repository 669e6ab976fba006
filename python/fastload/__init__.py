"""fastload: a Rust-accelerated safetensors loader for PyTorch.

The public names are imported lazily, so ``import fastload`` stays cheap and does not import
transformers unless an integration feature is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    FastloadFileNotFoundError,
    FastloadIOError,
    FastloadIsADirectoryError,
    FastloadNotADirectoryError,
    FastloadPermissionError,
    LoadCancelledError,
    MemoryBudgetError,
    ModelMismatchError,
    PickleRefusedError,
    ReloadError,
    RequestError,
    SafetensorError,
    TensorNotFoundError,
    TensorRefusedError,
    UninitializedTensorError,
    UnsupportedError,
)

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "load_file": "fastload.safetensors.files",
    "safe_open": "fastload.safetensors.files",
    "SafeOpen": "fastload.safetensors.files",
    "from_pretrained": "fastload.api",
    "reload": "fastload.reloading.entry",
    "ReloadReport": "fastload.reloading.report",
    "LoadReport": "fastload.core.plan.report",
    "gradient_checkpointing_enable": "fastload.training.gradient_checkpointing",
    "gradient_checkpointing_disable": "fastload.training.gradient_checkpointing",
    "is_gradient_checkpointing": "fastload.training.gradient_checkpointing",
    "unused_parameters": "fastload.training.readiness",
    "save_pretrained": "fastload.safetensors.saving",
    "save_file": "fastload.safetensors.saving",
    "load": "fastload.safetensors.serialize",
    "save": "fastload.safetensors.serialize",
    "save_model": "fastload.safetensors.serialize",
    "load_model": "fastload.safetensors.serialize",
    "patch_transformers": "fastload.hf.patch",
    "unpatch_transformers": "fastload.hf.patch",
    "patch_diffusers": "fastload.diffusion.patch",
    "unpatch_diffusers": "fastload.diffusion.patch",
    "diffusers_patched": "fastload.diffusion.patch",
}

__all__ = [
    "FastloadError",
    "CheckpointError",
    "UnsupportedError",
    "PickleRefusedError",
    "TensorNotFoundError",
    "RequestError",
    "FastloadIOError",
    "FastloadFileNotFoundError",
    "FastloadPermissionError",
    "FastloadIsADirectoryError",
    "FastloadNotADirectoryError",
    "TensorRefusedError",
    "ModelMismatchError",
    "ReloadError",
    "SafetensorError",
    "LoadCancelledError",
    "MemoryBudgetError",
    "UninitializedTensorError",
    "__version__",
    *_EXPORTS,
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only ("X as X" re-exports)
    from fastload.api import from_pretrained as from_pretrained
    from fastload.core.plan.report import LoadReport as LoadReport
    from fastload.diffusion.patch import diffusers_patched as diffusers_patched
    from fastload.diffusion.patch import patch_diffusers as patch_diffusers
    from fastload.diffusion.patch import unpatch_diffusers as unpatch_diffusers
    from fastload.hf.patch import patch_transformers as patch_transformers
    from fastload.hf.patch import unpatch_transformers as unpatch_transformers
    from fastload.reloading.entry import reload as reload
    from fastload.reloading.report import ReloadReport as ReloadReport
    from fastload.safetensors.files import SafeOpen as SafeOpen
    from fastload.safetensors.files import load_file as load_file
    from fastload.safetensors.files import safe_open as safe_open
    from fastload.safetensors.saving import save_file as save_file
    from fastload.safetensors.saving import save_pretrained as save_pretrained
    from fastload.safetensors.serialize import load as load
    from fastload.safetensors.serialize import load_model as load_model
    from fastload.safetensors.serialize import save as save
    from fastload.safetensors.serialize import save_model as save_model
    from fastload.training.gradient_checkpointing import (
        gradient_checkpointing_disable as gradient_checkpointing_disable,
    )
    from fastload.training.gradient_checkpointing import (
        gradient_checkpointing_enable as gradient_checkpointing_enable,
    )
    from fastload.training.gradient_checkpointing import (
        is_gradient_checkpointing as is_gradient_checkpointing,
    )
    from fastload.training.readiness import unused_parameters as unused_parameters
