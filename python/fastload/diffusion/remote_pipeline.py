"""A diffusers pipeline from object storage, under :func:`fastload.patch_diffusers`:
``DiffusionPipeline.from_pretrained("s3://bucket/pipeline/", storage_options=...)``.

diffusers' pipeline code reads local folders only, and much of a pipeline is small files it reads
itself (``model_index.json``, scheduler configs, tokenizer files). So:

1. ``model_index.json`` is fetched into a temporary directory, and for each component it names,
   that component's files other than weights (:data:`~fastload.core.checkpoint.side_files.
   WEIGHT_PATTERNS` never are): every small file of its prefix where the store lists
   (``s3://``, ``gs://``, ``az://``), the files diffusers and transformers components have by
   name (:data:`KNOWN_FILES`) over plain ``http(s)://``, which cannot list;
2. with a ``variant``, a component whose variant weights are in the store gets a marker file
   (``fastload-variant.<variant>.marker``) whose name diffusers' variant detection
   (``_identify_model_variants``, which looks at file names only) takes for them;
3. diffusers' own ``from_pretrained`` runs on that directory while it stands for the URL
   (:mod:`fastload.hf.remote_folders`): each diffusers model component is read by fastload from
   ``<url>/<component>/`` (:mod:`fastload.diffusion.remote`), each transformers one by the
   transformers patch's own URL path (:mod:`fastload.hf.front`), the weights streamed from the
   store into the allocated tensors, never written to disk.

With ``process_group=`` (taken by fastload, never passed to diffusers) the ranks of the group
load the pipeline together: each fetches the small files itself, and each component, diffusers'
and transformers' alike, is a collective load (:mod:`fastload.distributed`): each rank fetches
about 1/N of the weights' bytes and receives the rest from the others.

The directory is removed once the pipeline is built; the pipeline's ``_name_or_path`` is the URL.
A component fastload does not serve raises (``UnsupportedError`` naming the component, its URL
and why, :func:`fastload.hf.remote_folders.not_served`): diffusers' and transformers' own loaders
cannot read object storage. Not served: custom pipeline code in the bucket, ``revision``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from fastload.core.basics.errors import (
    CheckpointError,
    FastloadError,
    FastloadFileNotFoundError,
    UnsupportedError,
)
from fastload.core.plan.load_options import LoadOptions
from fastload.core.store.object_store import download_files, fetch_files, is_url, open_store
from fastload.core.store.store_config import check_storage_options
from fastload.diffusion import files as filesmod
from fastload.distributed.group import on_every_rank
from fastload.hf.front import _name_the_url
from fastload.hf.remote_folders import serving

__all__ = ["KNOWN_FILES", "PIPELINE_INDEX", "fetch_pipeline", "install", "uninstall"]

PIPELINE_INDEX = "model_index.json"
#: a component's small files fetched by name from a store that cannot list (plain HTTP)
KNOWN_FILES = (
    "config.json",
    "scheduler_config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)

_original: Any = None  # DiffusionPipeline's from_pretrained, while patched


def _variant_names(variant: str) -> list[str]:
    """The names a component's variant weights have: diffusers' (one file, index, legacy index)
    and transformers' (one file, index)."""
    return [
        filesmod.add_variant(filesmod.SINGLE, variant),
        filesmod.add_variant(filesmod.INDEX, variant),
        filesmod.legacy_index(variant),
        f"model.{variant}.safetensors",
        f"model.safetensors.index.{variant}.json",
    ]


def _components(index: Any, where: str) -> list[str]:
    """The components of a pipeline's ``model_index.json`` that have files of their own."""
    if not isinstance(index, dict):
        raise CheckpointError(f"{where}: not a diffusers pipeline index (a JSON object)")
    names = []
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, (list, tuple)) or len(value) != 2:
            continue
        if value[0] is None or value[1] is None:  # a component left out (safety_checker=None)
            continue
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise CheckpointError(f"{where}: component name {name!r} is not a folder name")
        names.append(name)
    return names


def fetch_pipeline(
    url: str, destination: Path, *, variant: str | None, storage_options: Any
) -> list[str]:
    """Fetches the pipeline at ``url``'s small files into ``destination`` (see the module's
    docstring); returns its components. ``FastloadFileNotFoundError`` naming the URL when it
    holds no ``model_index.json``; ``CheckpointError`` naming the variant when no component has
    its weights."""
    prefix = url.split("?", 1)[0].rstrip("/") + "/"
    if not fetch_files(prefix, [PIPELINE_INDEX], destination, storage_options=storage_options):
        raise FastloadFileNotFoundError(
            f"{prefix}: no {PIPELINE_INDEX} there; a diffusers pipeline is built from it"
        )
    try:
        index = json.loads((destination / PIPELINE_INDEX).read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{prefix}{PIPELINE_INDEX}: not JSON ({e})") from e
    components = _components(index, prefix + PIPELINE_INDEX)
    lists = prefix.split("://", 1)[0].lower() not in ("http", "https")
    with_variant = []
    for name in components:
        folder, sub = destination / name, f"{prefix}{name}/"
        if lists:
            download_files(sub, folder, storage_options=storage_options)
        else:
            fetch_files(sub, KNOWN_FILES, folder, storage_options=storage_options)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # nothing there: diffusers then loads the component from the root
        if variant and folder.is_dir():
            store = open_store(sub, storage_options)
            key = store.key.rstrip("/")
            if any(store.head(f"{key}/{n}") is not None for n in _variant_names(variant)):
                (folder / f"fastload-variant.{variant}.marker").write_bytes(b"")
                with_variant.append(name)
    if variant and not with_variant:
        raise CheckpointError(
            f"{prefix}: no component has weights of variant={variant!r} (looked for "
            f"{', '.join(_variant_names(variant))} in {', '.join(components)})"
        )
    return components


def load_pipeline(load: Any, cls: type, url: str, kwargs: dict[str, Any]) -> Any:
    """``load(cls, folder, **kwargs)`` (diffusers' own ``from_pretrained``) on the pipeline at
    ``url`` fetched as the module's docstring says."""
    kwargs = dict(kwargs)
    storage = check_storage_options(kwargs.pop("storage_options", None), url)
    group = kwargs.pop("process_group", None)
    for name in ("revision", "custom_pipeline", "custom_revision"):
        if kwargs.get(name) not in (None, "main"):
            raise UnsupportedError(
                f"{url}: {name}={kwargs[name]!r} is not served for a pipeline in object storage"
            )
    if group is not None and kwargs.get("device_map") is not None:
        raise UnsupportedError(
            f"{url}: process_group (a collective load) and device_map={kwargs['device_map']!r} "
            "cannot be combined; load on one device, then move the pipeline (pipe.to(...))"
        )
    # a collective load's options (the group checked here, before anything is fetched): the
    # small files are fetched on every rank alike, a failure on one raised on all
    options = LoadOptions.create("from_pretrained", process_group=group)
    with tempfile.TemporaryDirectory(prefix="fastload-pipeline-") as tmp:
        try:
            on_every_rank(
                options,
                lambda: fetch_pipeline(
                    url, Path(tmp), variant=kwargs.get("variant"), storage_options=storage
                ),
            )
            with serving(tmp, url, storage, group):
                pipe = load(cls, tmp, **kwargs)
        except FastloadError as e:
            _name_the_url(e, tmp, url.split("?", 1)[0].rstrip("/") + "/")
            raise
    pipe.register_to_config(_name_or_path=url)
    return pipe


def _from_pretrained(cls: type, pretrained_model_name_or_path: Any, **kwargs: Any) -> Any:
    original = _original
    if original is None:  # unpatched meanwhile: the class's own method is diffusers'
        return cls.from_pretrained(pretrained_model_name_or_path, **kwargs)  # type: ignore[attr-defined]
    if not is_url(pretrained_model_name_or_path):
        if kwargs.get("process_group") is not None:  # diffusers would ignore it, with a warning
            raise UnsupportedError(
                f"{cls.__name__}.from_pretrained({pretrained_model_name_or_path!r}): "
                "process_group= is served for a pipeline read from object storage (a URL) only; "
                "each rank loads a local pipeline itself"
            )
        kwargs.pop("process_group", None)
        return original.__func__(cls, pretrained_model_name_or_path, **kwargs)
    return load_pipeline(original.__func__, cls, pretrained_model_name_or_path, kwargs)


def _extract_init_dict(cls: type, /, config_dict: Any, **kwargs: Any) -> Any:
    """diffusers' ``extract_init_dict`` with the components in the order of their names.

    diffusers builds a pipeline's ``init_dict`` by iterating a set of names, so each process
    loads the components in an order of its own (string hashes differ between processes); the
    ranks of a collective load must load them in one order, each component's load being a
    collective step of its own. The pipeline built is the same in any order."""
    original = _original_extract
    if original is None:  # unpatched meanwhile
        from diffusers.configuration_utils import ConfigMixin

        original = ConfigMixin.extract_init_dict
    init_dict, unused, hidden = original.__func__(cls, config_dict, **kwargs)
    return dict(sorted(init_dict.items())), unused, hidden


_original_extract: Any = None  # DiffusionPipeline's extract_init_dict (bound), while patched
_own_extract: Any = None  # the one DiffusionPipeline defines itself, if it does


def install() -> None:
    """Routes ``DiffusionPipeline.from_pretrained`` of a URL through :func:`load_pipeline`
    (other names go to the method it replaces, unchanged), its components loaded in the order of
    their names (:func:`_extract_init_dict`)."""
    global _original, _original_extract, _own_extract
    from diffusers import DiffusionPipeline

    if _original is None:
        _original = DiffusionPipeline.__dict__["from_pretrained"]
        _original_extract = DiffusionPipeline.extract_init_dict
        _own_extract = DiffusionPipeline.__dict__.get("extract_init_dict")
        DiffusionPipeline.from_pretrained = classmethod(_from_pretrained)  # type: ignore[assignment, arg-type]
        setattr(DiffusionPipeline, "extract_init_dict", classmethod(_extract_init_dict))  # noqa: B010


def uninstall() -> None:
    """Puts back the ``DiffusionPipeline`` methods :func:`install` replaced."""
    global _original, _original_extract, _own_extract
    from diffusers import DiffusionPipeline

    if _original is not None:
        DiffusionPipeline.from_pretrained = _original  # type: ignore[method-assign]
        if _own_extract is not None:
            setattr(DiffusionPipeline, "extract_init_dict", _own_extract)  # noqa: B010
        else:  # inherited again
            delattr(DiffusionPipeline, "extract_init_dict")
        _original, _original_extract, _own_extract = None, None, None
