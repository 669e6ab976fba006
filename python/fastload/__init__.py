"""fastload: a Rust-accelerated safetensors loader for PyTorch.

The public names are imported lazily, so ``import fastload`` stays cheap and does not import
transformers unless an integration feature is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastload.errors import (
    CheckpointError,
    FastloadError,
    FastloadIOError,
    LoadCancelledError,
    PickleRefusedError,
    RequestError,
    TensorNotFoundError,
    UnsupportedError,
)

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "load_file": "fastload.reader",
    "safe_open": "fastload.reader",
    "SafeOpen": "fastload.reader",
    "from_pretrained": "fastload.loading",
    "LoadReport": "fastload.report",
    "gradient_checkpointing_enable": "fastload.checkpointing",
    "gradient_checkpointing_disable": "fastload.checkpointing",
    "is_gradient_checkpointing": "fastload.checkpointing",
    "unused_parameters": "fastload.training",
    "save_pretrained": "fastload.saving",
    "save_file": "fastload.saving",
}

__all__ = [
    "FastloadError",
    "CheckpointError",
    "UnsupportedError",
    "PickleRefusedError",
    "TensorNotFoundError",
    "RequestError",
    "FastloadIOError",
    "LoadCancelledError",
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


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from fastload.checkpointing import (
        gradient_checkpointing_disable,
        gradient_checkpointing_enable,
        is_gradient_checkpointing,
    )
    from fastload.loading import from_pretrained
    from fastload.reader import SafeOpen, load_file, safe_open
    from fastload.report import LoadReport
    from fastload.saving import save_file, save_pretrained
    from fastload.training import unused_parameters
