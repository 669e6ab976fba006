"""The diffusers layer of fastload: diffusers' models (UNets, VAEs, diffusion transformers) loaded
the way diffusers loads them, read by fastload.

diffusers owns what a model means (its configs, file names, variants, legacy key renames,
``_keep_in_fp32_modules``); fastload owns reading. This subpackage gives the core loader the
family's hooks, beside the Hugging Face layer (whose hub resolution it uses):

* :mod:`~fastload.diffusion.options`: every option of diffusers' ``ModelMixin.from_pretrained``,
  honoured with diffusers' meaning or refused with ``UnsupportedError`` naming it;
* :mod:`~fastload.diffusion.files`: a model's folder, config and weights (``subfolder``,
  ``variant``, sharded or not, the legacy sharded variant layout), local or by model id;
* :mod:`~fastload.diffusion.hooks`: what the core asks of a diffusers model (names, dtype rules,
  finishing, diffusers' warnings);
* :mod:`~fastload.diffusion.front`: the load of a diffusers model, from a class and a name to the
  core loader;
* :mod:`~fastload.diffusion.patch`: :func:`~fastload.diffusion.patch.patch_diffusers`, routing
  diffusers' own ``ModelMixin.from_pretrained`` through fastload (or leaving a call whole to
  diffusers).

Nothing here is imported by ``import fastload``; diffusers is imported only when used.

May import: :mod:`fastload.core`, :mod:`fastload.distributed`, :mod:`fastload.training`,
:mod:`fastload.safetensors`, :mod:`fastload.families`, :mod:`fastload.hf`.
"""

from __future__ import annotations
