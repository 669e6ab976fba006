"""The renamings transformers registers for an architecture, applied to checkpoint names.

transformers keeps, per architecture, the renames that turn old checkpoint names into the current
ones (``LayerNorm.gamma`` -> ``LayerNorm.weight``, moved prefixes) and the converters that merge or
split tensors (MoE experts, fused qkv). fastload applies the renames here; the converters are
planned by :mod:`fastload.hf.conversions`.
"""

from __future__ import annotations

from torch import nn

from fastload.core.keys import Rename


def transformers_renames(model: nn.Module, source: str) -> list[Rename]:
    """The renamings transformers registers for this architecture (legacy ``LayerNorm.gamma``
    included)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without registered conversions: nothing to apply
        return []

    transforms = get_model_conversion_mapping(model)
    renames: list[Rename] = [
        (lambda name, t=t: t.rename_source_key(name)[0])
        for t in transforms
        if isinstance(t, WeightRenaming)
    ]
    # Tensors a converter merges or splits are planned by fastload.hf.conversions first.
    return renames
