"""Which model family a model belongs to: the one question the layers above the core ask by name.

The core (:mod:`fastload.core`) never asks it: the entry of a load chooses a family's hooks
(:mod:`fastload.core.plan.hooks`) and passes them in. The layers that serve a family by its own
conventions ask it here: the entry (:mod:`fastload.api`), the Hugging Face layer
(:mod:`fastload.hf`), the diffusers layer (:mod:`fastload.diffusion`), saving
(:mod:`fastload.safetensors.saving`) and the training toggles (:mod:`fastload.training`).
Importing this module imports no framework.

May import: nothing of fastload (a leaf beside the core).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_diffusers_model", "is_transformers_model"]


def is_transformers_model(obj: Any) -> bool:
    """Whether ``obj`` (a class or an instance) is a transformers ``PreTrainedModel``.

    Never imports transformers: a transformers class can only exist if it is already imported.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return False
    base = modeling.PreTrainedModel
    return isinstance(obj, base) or (isinstance(obj, type) and issubclass(obj, base))


def is_diffusers_model(obj: Any) -> bool:
    """Whether ``obj`` (a class or an instance) is a diffusers ``ModelMixin`` (a UNet, a VAE, a
    diffusion transformer...).

    Never imports diffusers: a diffusers class can only exist if it is already imported.
    """
    modeling = sys.modules.get("diffusers.models.modeling_utils")
    if modeling is None:
        return False
    base = modeling.ModelMixin
    return isinstance(obj, base) or (isinstance(obj, type) and issubclass(obj, base))
