"""transformers' dtype rules: what ``dtype="auto"`` means, and the modules kept in float32.

The rule, in one place (docs/transformers.md, "dtype, MoE checkpoints, initialization", says the
same):

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
* An integer tensor keeps its integer dtype; under the patch, where transformers' result is the
  contract, one loaded into a module kept in float32 becomes float32 as transformers makes it
  (BatchNorm's ``num_batches_tracked`` in Granite Speech's ``conv.norm``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fastload.core.basics.dtypes import CONVERTIBLE, parse_dtype, to_st
from fastload.core.checkpoint.opened import OpenCheckpoint

if TYPE_CHECKING:
    from fastload.core.plan.report import LoadReport


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


def cast_kept_integers(model: nn.Module, keep_fp32: re.Pattern[str], report: LoadReport) -> None:
    """Loaded integer tensors of the modules kept in float32, made float32 as transformers'
    loader casts every tensor of those modules to float32 (its dtype plan), integers included."""
    not_loaded = {*report.missing, *report.authorized_missing, *report.initialized}
    not_loaded |= {name for name, _, _ in report.mismatched}
    for prefix, module in model.named_modules():
        for store in (module._parameters, module._buffers):
            for attr, tensor in list(store.items()):
                name = f"{prefix}.{attr}" if prefix else attr
                if tensor is None or tensor.is_floating_point() or tensor.is_complex():
                    continue
                if name in not_loaded or keep_fp32.search(name) is None:
                    continue
                if attr in module._non_persistent_buffers_set:
                    continue  # never in a checkpoint
                cast = tensor.to(torch.float32)
                store[attr] = nn.Parameter(cast) if store is module._parameters else cast
