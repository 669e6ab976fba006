"""The renamings transformers registers for an architecture, applied to checkpoint names.

transformers keeps, per architecture, the renames that turn old checkpoint names into the current
ones (``LayerNorm.gamma`` -> ``LayerNorm.weight``, moved prefixes) and the converters that merge or
split tensors (MoE experts). fastload applies the renames; a checkpoint that needs a converter is
refused here (merging is the job of the conversions module of this layer where it exists).
"""

from __future__ import annotations

from torch import nn

from fastload.errors import UnsupportedError
from fastload.keys import Rename


def transformers_renames(model: nn.Module, source: str) -> list[Rename]:
    """The renamings transformers registers for this architecture (legacy ``LayerNorm.gamma``
    included); a checkpoint that needs one of its tensor-merging conversions is refused."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without registered conversions: nothing to apply
        return []

    transforms = get_model_conversion_mapping(model)
    renames: list[Rename] = [
        (lambda name, t=t: t.rename_source_key(name)[0])
        for t in transforms
        if isinstance(t, WeightRenaming)
    ]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if converters:

        def refuse(name: str) -> str:
            for c in converters:
                if c.rename_source_key(name)[1] is not None:
                    raise UnsupportedError(
                        f"{source}: tensor {name!r} needs transformers' conversion "
                        f"{c.source_patterns} -> {c.target_patterns}, which merges or splits "
                        "tensors; fastload only renames. Load it once with transformers and save "
                        "it with save_pretrained"
                    )
            return name

        renames.append(refuse)
    return renames
