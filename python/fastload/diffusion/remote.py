"""A diffusers model in object storage: ``s3://``, ``gs://``, ``az://``, ``http(s)://`` prefixes.

The model's folder is a prefix (``s3://bucket/pipeline/`` with ``subfolder="unet"``, or
``s3://bucket/pipeline/unet/``) holding what a local folder holds, in diffusers' names
(:mod:`fastload.diffusion.files`). Its ``config.json`` is fetched into a temporary directory
(:func:`fastload.hf.hub.resolve_remote`, the transformers side's fetch of side files, here with
diffusers' weight names) and read by the class as a local one; the weights (one file or a sharded
index, a variant, the legacy sharded variant index) are never downloaded: the core reads their
headers, then streams their bytes from the store into the tensors it allocated
(:mod:`fastload.core.store.object_store`). With ``process_group=`` each rank fetches about 1/N of
them and the ranks exchange the rest (:mod:`fastload.distributed`).

A path inside the temporary folder of a pipeline read from a URL
(:mod:`fastload.diffusion.remote_pipeline`) stands for that URL
(:mod:`fastload.hf.remote_folders`) and is read from it the same way.

Not served from object storage: pickle weights (``use_safetensors=False``), a model id's
``revision``, a quantized config (diffusers' quantizers load local files only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    FastloadFileNotFoundError,
    UnsupportedError,
)
from fastload.core.plan.load_options import LoadOptions
from fastload.core.store.object_store import ObjectUrl, is_url
from fastload.core.store.side_directory import side_files_directory
from fastload.diffusion import files as filesmod
from fastload.diffusion.options import DiffusersOptions
from fastload.distributed.group import on_every_rank
from fastload.hf import hub as hubmod
from fastload.hf.front import _name_the_url
from fastload.hf.remote_folders import lookup

__all__ = ["Located", "is_remote", "located", "resolve"]


@dataclass(frozen=True)
class Located:
    """A diffusers model found: its ``files`` (``folder``: where ``config.json`` is read, a
    temporary directory for a URL), the ``options`` of its load (with the ``storage_options``
    of the pipeline it belongs to), the ``name`` it was asked for (the URL a pipeline's folder
    stands for), and the folder as messages ``show`` it (the URL's prefix)."""

    files: filesmod.ModelFiles
    options: LoadOptions
    name: Any
    shown: Path | ObjectUrl


def is_remote(path: object) -> bool:
    """Whether ``path`` is read from object storage: a URL, or a path in the folder of a pipeline
    read from one."""
    return is_url(path) or lookup(path) is not None


def resolve(
    url: str,
    destination: Path,
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    storage_options: Any = None,
) -> filesmod.ModelFiles:
    """The diffusers model at the prefix ``url`` (``subfolder`` under it): its ``config.json``
    fetched into ``destination``, and the URL of its weights, looked for in diffusers' order
    (the sharded index, the legacy sharded variant index, one file). A ``CheckpointError``
    naming the prefix and the names looked for when none is there (a variant that is not in the
    bucket), ``FastloadFileNotFoundError`` when ``config.json`` is not."""
    stripped = url.split("?", 1)[0].rstrip("/")
    if not subfolder and stripped.endswith((".safetensors", ".json")):
        raise CheckpointError(
            f"{url}: a diffusers model is loaded from its folder (config.json and "
            f"{filesmod.SINGLE}), not from one file"
        )
    names = [filesmod.add_variant(filesmod.INDEX, variant)]
    names += [filesmod.legacy_index(variant)] if variant else []
    names.append(filesmod.add_variant(filesmod.SINGLE, variant))
    found = hubmod.resolve_remote(
        url,
        destination,
        hub=hub,
        subfolder=subfolder,
        variant=variant,
        use_safetensors=use_safetensors,
        storage_options=storage_options,
        weights=names,
        side_files=[filesmod.CONFIG_NAME],
    )
    weights = str(found.weights)
    prefix = weights.rsplit("/", 1)[0] + "/"
    if not (destination / filesmod.CONFIG_NAME).is_file():
        raise FastloadFileNotFoundError(
            f"{prefix}: no {filesmod.CONFIG_NAME} there; a diffusers model is built from it"
        )
    if variant and weights.endswith("/" + filesmod.legacy_index(variant)):
        warnings.warn(filesmod.LEGACY_MESSAGE.format(variant=variant), FutureWarning, 3)
    _refuse_quantized(destination / filesmod.CONFIG_NAME, prefix)
    return filesmod.ModelFiles(destination, ObjectUrl(weights), weights.endswith(".json"))


def _refuse_quantized(config: Path, prefix: str) -> None:
    """``UnsupportedError`` for a config with a ``quantization_config``: diffusers' quantizers
    read local files, and fastload does not load such a model as an unquantized one."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # the class's own reading of it names what is wrong
    if isinstance(data, dict) and data.get("quantization_config") is not None:
        raise UnsupportedError(
            f"{prefix}{filesmod.CONFIG_NAME}: a quantized model (quantization_config); fastload "
            "does not read quantized diffusers models from object storage"
        )


@contextmanager
def located(path: Any, options: LoadOptions, opts: DiffusersOptions) -> Iterator[Located]:
    """The files of the model at ``path`` while the body reads its config: a local folder or a
    model id (:func:`fastload.diffusion.files.resolve`), or a URL (:func:`resolve`, on every rank
    of a collective load alike), its fetched ``config.json`` removed at the end and an error the
    body raises naming the URL where it named that temporary directory."""
    remote = lookup(path)
    url = remote.url if remote is not None else path if is_url(path) else None
    if url is None:
        files = filesmod.resolve(
            path,
            hub=opts.hub,
            subfolder=opts.subfolder,
            variant=opts.variant,
            use_safetensors=opts.use_safetensors,
            allow_pickle=options.allow_pickle,
        )
        yield Located(files, options, path, files.folder)
        return
    if remote is not None and options.storage_options is None:
        options = dataclasses.replace(options, storage_options=remote.storage_options)
    if remote is not None and remote.process_group is not None and not options.collective:
        # a component of a pipeline's collective load (fastload.diffusion.remote_pipeline)
        options = dataclasses.replace(options, process_group=remote.process_group)
    with side_files_directory() as side:
        files = on_every_rank(
            options,
            lambda: resolve(
                url,
                Path(side),
                hub=opts.hub,
                subfolder=opts.subfolder,
                variant=opts.variant,
                use_safetensors=opts.use_safetensors,
                storage_options=options.storage_options,
            ),
        )
        prefix = ObjectUrl(str(files.weights).rsplit("/", 1)[0])
        try:
            yield Located(files, options, url, prefix)
        except FastloadError as e:
            _name_the_url(e, os.fspath(side), str(files.weights))
            raise
