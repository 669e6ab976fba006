"""The Hugging Face layer of fastload: model ids, transformers classes, options and conventions.

The core loader (:mod:`fastload.core.loading`) knows any ``nn.Module``; this subpackage adds what is
specific to the Hugging Face ecosystem, and calls the core:

* :mod:`~fastload.hf.hub`: model ids resolved through ``huggingface_hub`` (its cache, revisions,
  offline mode), subfolders and weight variants;
* :mod:`~fastload.hf.options`: every option of transformers' ``from_pretrained``, honoured with
  transformers' meaning or refused with ``UnsupportedError`` naming it;
* :mod:`~fastload.hf.auto`: Auto classes, ``config.json``'s ``architectures`` and remote code;
* :mod:`~fastload.hf.front`: the load of a transformers model, from a name to the core loader;
* :mod:`~fastload.hf.hooks`, :mod:`~fastload.hf.renames`, :mod:`~fastload.hf.finish`: what the
  core asks of a transformers model (renames, authorized names, fp32 modules, finishing);
* :mod:`~fastload.hf.conversions`: transformers' tensor merges and splits (MoE experts, fused
  ``qkv``) planned as reads into slices; :mod:`~fastload.hf.dtype_rules`: what ``dtype="auto"``
  means for a transformers model, and the modules kept in float32;
* :mod:`~fastload.hf.quantized`: pre-quantized checkpoints, read into the modules transformers'
  own quantizer makes (its hooks driven in transformers' order; methods it has load operations
  for refused by name);
* :mod:`~fastload.hf.patch`: :func:`patch_transformers`, routing ``PreTrainedModel.from_pretrained``
  (hence ``AutoModel*``, pipelines, sentence-transformers) through fastload.

Nothing here is imported by ``import fastload``; transformers is imported only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["patch_transformers", "unpatch_transformers", "is_patched"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fastload.hf import patch

        return getattr(patch, name)
    raise AttributeError(f"module 'fastload.hf' has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from fastload.hf.patch import is_patched, patch_transformers, unpatch_transformers
