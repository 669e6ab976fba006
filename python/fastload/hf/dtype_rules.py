"""transformers' dtype rules: what ``dtype="auto"`` means, and the modules kept in float32.

The rule, in one place (the README's "dtype" section says the same):

* ``dtype="auto"`` for a transformers model fastload builds means what it means in transformers 5:
  the dtype the config records (``config.dtype``, written by ``save_pretrained``), else the
  ``dtype`` entry of a sharded checkpoint's index metadata, else the dtype of the first floating
  tensor (by name) of the first checkpoint file. The model is built under that dtype, and every
  loaded floating tensor is converted to it, with the exceptions below.
* ``_keep_in_fp32_modules`` are float32 when that dtype is float16; ``_keep_in_fp32_modules_strict``
  when it is float16 or bfloat16 (transformers' ``_get_dtype_plan``; patterns searched in model
  tensor names).
* A tensor the model creates in another dtype whatever the default dtype (XLNet's ``mask_emb``,
  DeBERTa's and Reformer's float32 tensors, ESM's ``inv_freq``...) keeps that dtype.
* ``dtype="stored"`` keeps each tensor's stored dtype; it is also what ``"auto"`` means for
  models that are not transformers models, and for a module passed in already built.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from fastload.core.checkpoint import OpenCheckpoint
from fastload.core.dtypes import CONVERTIBLE, parse_dtype, to_st


def _floating(value: Any) -> torch.dtype | None:
    try:
        dtype = parse_dtype(value)
    except Exception:  # noqa: BLE001 - an unreadable record falls through to the next rule
        return None
    return dtype if to_st(dtype) in CONVERTIBLE else None


def auto_dtype(config: Any, ckpt: OpenCheckpoint) -> torch.dtype | None:
    """transformers 5's ``dtype="auto"``: the config's dtype, then the index metadata's, then the
    first floating tensor's of the first file (``None``: torch's default dtype)."""
    recorded = getattr(config, "dtype", None)
    if recorded is not None:
        return _floating(recorded)
    metadata = ckpt.location.index_metadata or {}
    if metadata.get("dtype") is not None:
        return _floating(metadata["dtype"])
    first_file = sorted(t.name for t in ckpt.tensors.values() if t.file == 0)
    for name in first_file:
        stored = ckpt.tensors[name]
        if stored.st_dtype in CONVERTIBLE:
            return stored.dtype
    return None


def keep_fp32_pattern(model: Any, dtype: torch.dtype | None) -> re.Pattern[str] | None:
    """transformers' ``_keep_in_fp32_modules`` (for float16) and ``..._strict`` (float16 and
    bfloat16) as one regex, searched in model tensor names as transformers does."""
    patterns: list[str] = []
    if dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if dtype in (torch.float16, torch.bfloat16):
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    patterns = [p.replace("*", ".*") for p in patterns if p]
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p})" for p in patterns))
