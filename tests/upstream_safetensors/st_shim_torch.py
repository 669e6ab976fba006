"""The names the upstream tests import from ``safetensors.torch``, mapped onto fastload.

The private helpers (``_find_shared_tensors`` ...) are fastload's own implementation of
safetensors' shared-tensor rules, which ``fastload.save_model``/``load_model`` use.
"""

from __future__ import annotations

from fastload import load, load_file, load_model, save, save_file, save_model
from fastload.safetensors.serialize import (
    _end_ptr,
    _find_shared_tensors,
    _is_complete,
    _remove_duplicate_names,
    storage_ptr,
    storage_size,
)

__all__ = [
    "load",
    "load_file",
    "load_model",
    "save",
    "save_file",
    "save_model",
    "_end_ptr",
    "_find_shared_tensors",
    "_is_complete",
    "_remove_duplicate_names",
    "storage_ptr",
    "storage_size",
]
