"""The renamings transformers registers for an architecture, applied to checkpoint names.

transformers keeps, per architecture, the renames that turn old checkpoint names into the current
ones (``LayerNorm.gamma`` -> ``LayerNorm.weight``, moved prefixes) and the converters that merge or
split tensors (MoE experts, fused qkv). fastload applies the renames here; the converters are
planned by :mod:`fastload.hf.conversions`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from fastload.core.model.keys import Rename


def transformers_renames(model: nn.Module, source: str, quantizer: Any = None) -> list[Rename]:
    """The renamings transformers registers for this architecture (legacy ``LayerNorm.gamma``
    included), and those its ``quantizer`` adds for a pre-quantized checkpoint."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without registered conversions: nothing to apply
        return []

    transforms = get_model_conversion_mapping(model, hf_quantizer=quantizer)
    renames: list[Rename] = [
        (lambda name, t=t: t.rename_source_key(name)[0])
        for t in transforms
        if isinstance(t, WeightRenaming)
    ]
    # Tensors a converter merges or splits are planned by fastload.hf.conversions first.
    return renames


def transformers_prefix_rule(prefix: str | None) -> Callable[[str, str, set[str]], str]:
    """transformers' last step of naming a checkpoint tensor (``rename_source_key`` in its
    ``core_model_loading``): the base-model prefix is stripped when that makes a model name, else
    added when that does, even where the name already is a model name; a stored name that is a
    model name and that the renames turned into none is taken as stored, with the same prefix
    step. fastload's own step changes a name only when it is not a model name (a head whose
    layer shares its name with one of the base model's: Pixio's ``layernorm`` and
    ``pixio.layernorm``, which transformers swaps); this one is used under the patch."""

    def prefixed(key: str, model_keys: set[str]) -> str:
        if prefix is None:
            return key
        if key.startswith(prefix):
            stripped = re.sub(f"^{prefix}.", "", key, count=1)
            if stripped in model_keys:
                return stripped
        if f"{prefix}.{key}" in model_keys:
            return f"{prefix}.{key}"
        return key

    def resolve(renamed: str, stored: str, model_keys: set[str]) -> str:
        name = prefixed(renamed, model_keys)
        if name not in model_keys and stored in model_keys:
            name = prefixed(stored, model_keys)
        return name

    return resolve
