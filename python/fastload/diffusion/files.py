"""Finding a diffusers model's files: its folder, its config and its weights, in diffusers' names.

A diffusers model lies in a folder (a pipeline's ``unet/``, ``vae/``, ``transformer/``: the
``subfolder``) holding ``config.json`` and its weights, in diffusers' names
(``diffusers/models/modeling_utils.py``, ``model_loading_utils.py``):

* sharded: ``diffusion_pytorch_model.safetensors.index.json``, with a variant
  ``diffusion_pytorch_model.safetensors.index.<variant>.json`` (diffusers puts the variant
  before the last suffix), or the legacy layout
  ``diffusion_pytorch_model.safetensors.<variant>.index.json`` (served with diffusers'
  ``FutureWarning``);
* one file: ``diffusion_pytorch_model.safetensors``
  (``diffusion_pytorch_model.<variant>.safetensors``);
* pickle weights ``diffusion_pytorch_model.bin`` (read with ``torch.load(weights_only=True)``
  only with ``allow_pickle=True``, or ``use_safetensors=False``), when no safetensors file is
  there.

The sharded index is looked for first, as diffusers does. A model id is resolved through the Hugging
Face layer's snapshot (:func:`fastload.hf.hub.snapshot`: its cache first, offline with
``HF_HUB_OFFLINE=1``), downloading only the files of this folder and variant.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.core.basics.errors import CheckpointError, FastloadIOError, UnsupportedError
from fastload.core.store.object_store import ObjectUrl
from fastload.hf import hub as hubmod

__all__ = ["CONFIG_NAME", "SINGLE", "INDEX", "PICKLE", "ModelFiles", "add_variant", "resolve"]

CONFIG_NAME = "config.json"
SINGLE = "diffusion_pytorch_model.safetensors"
INDEX = "diffusion_pytorch_model.safetensors.index.json"
PICKLE = "diffusion_pytorch_model.bin"

#: diffusers' words for the legacy sharded variant layout (its ``deprecate`` warning)
LEGACY_MESSAGE = (
    "This serialization format is now deprecated to standardize the serialization format between "
    "`transformers` and `diffusers`. We recommend you to remove the existing files associated with "
    "the current variant ({variant}) and re-obtain them by running a `save_pretrained()`."
)


@dataclass(frozen=True)
class ModelFiles:
    """A diffusers model found: the ``folder`` with its ``config.json`` (the subfolder joined),
    the ``weights`` the core loader reads (a file or a sharded index) and whether they are
    ``sharded`` (diffusers renames legacy attention keys only in a single file). From object
    storage (:mod:`fastload.diffusion.remote`), ``weights`` is the URL the core streams them from
    and ``folder`` the temporary directory ``config.json`` was fetched into."""

    folder: Path
    weights: Path | ObjectUrl
    sharded: bool


def add_variant(name: str, variant: str | None) -> str:
    """``name`` with ``variant`` before its last suffix, as diffusers' ``_add_variant`` does:
    ``diffusion_pytorch_model.fp16.safetensors``, ``...safetensors.index.fp16.json``."""
    if not variant:
        return name
    head, _, last = name.rpartition(".")
    return f"{head}.{variant}.{last}"


def legacy_index(variant: str) -> str:
    """The legacy sharded variant index's name:
    ``diffusion_pytorch_model.safetensors.<variant>.index.json``."""
    return INDEX.replace(".index.json", f".{variant}.index.json")


def _patterns(subfolder: str, variant: str | None, pickle: bool) -> list[str]:
    """The files of one model folder a snapshot downloads."""
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    stem = add_variant("diffusion_pytorch_model.x", variant).removesuffix(".x")
    names = [CONFIG_NAME, add_variant(SINGLE, variant), add_variant(INDEX, variant)]
    names.append(f"{stem}-*-of-*.safetensors")
    if variant:
        names += [legacy_index(variant), f"diffusion_pytorch_model-*-of-*.{variant}.safetensors"]
    if pickle:
        names.append(add_variant(PICKLE, variant))
    return [prefix + n for n in names]


def resolve(
    name: str | os.PathLike[str],
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    allow_pickle: bool = False,
) -> ModelFiles:
    """The folder and weights of the diffusers model at ``name`` (a local directory, or a model
    id resolved through ``huggingface_hub``), in ``subfolder``, for ``variant``.

    Raises ``FastloadIOError`` (an ``OSError``) for a directory or model id that is not there,
    and ``CheckpointError`` (a ``ValueError``) naming the folder and the files looked for when
    none of the weights is there (a variant that does not exist)."""
    subfolder = subfolder or ""
    path = Path(os.fspath(name))
    pickle = use_safetensors is False or (use_safetensors is None and allow_pickle)
    if hubmod.is_local(path):
        if variant and any(bad in variant for bad in ("/", "\\", "..", "\x00")):
            raise FastloadIOError(
                f"variant={variant!r} leads outside {path}: a variant is part of a file name"
            )
        if hub.get("revision") not in (None, "main"):
            raise UnsupportedError(
                f"{path}: revision={hub['revision']!r} applies to model ids, not local directories"
            )
        if path.is_file():
            raise CheckpointError(
                f"{path}: a diffusers model is loaded from its folder (config.json and "
                f"{SINGLE}), not from one file"
            )
    else:
        path = hubmod.snapshot(
            os.fspath(name),
            hub=hub,
            subfolder=subfolder,
            variant=variant,
            patterns=_patterns(subfolder, variant, pickle),
        )
    folder = path / subfolder if subfolder else path
    if not folder.is_dir():
        raise FastloadIOError(f"{folder}: no such directory (subfolder={subfolder!r})")
    weights, sharded = _weights(folder, variant, use_safetensors, pickle)
    return ModelFiles(folder, weights, sharded)


def _weights(
    folder: Path, variant: str | None, use_safetensors: bool | None, pickle: bool
) -> tuple[Path, bool]:
    """diffusers' choice of weights in ``folder``: the sharded index, the legacy sharded
    variant's index, one safetensors file, then (when allowed) the pickle file."""
    looked: list[str] = []
    if use_safetensors is not False:
        for index in [add_variant(INDEX, variant)] + ([legacy_index(variant)] if variant else []):
            looked.append(index)
            if (folder / index).is_file():
                if variant and index == legacy_index(variant):
                    warnings.warn(LEGACY_MESSAGE.format(variant=variant), FutureWarning, 3)
                return folder / index, True
        looked.append(add_variant(SINGLE, variant))
        if (folder / looked[-1]).is_file():
            return folder / looked[-1], False
    if pickle or use_safetensors is None:
        # without allow_pickle the core refuses it by name (PickleRefusedError)
        looked.append(add_variant(PICKLE, variant))
        if (folder / looked[-1]).is_file():
            return folder / looked[-1], False
    what = f" (variant={variant!r})" if variant else ""
    raise CheckpointError(
        f"{folder}: no weights of a diffusers model{what} there: looked for {', '.join(looked)}"
    )
