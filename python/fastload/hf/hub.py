"""Finding a checkpoint by model id or path: the Hugging Face cache, subfolders, weight variants.

A local directory or file is used as is. Anything else that is a valid repo id
(``"org/name"``) is resolved by ``huggingface_hub``'s ``snapshot_download``: from the cache
(``HF_HOME`` / ``HF_HUB_CACHE`` or ``cache_dir``) when it holds the revision, downloading the
files a load needs otherwise, offline with ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``.
The cache layout is the library's business; nothing here knows it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.checkpoint import INDEX_FILE, SINGLE_FILE
from fastload.errors import CheckpointError, FastloadIOError, UnsupportedError

_PICKLE_SINGLE = "pytorch_model.bin"
_PICKLE_INDEX = "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class Resolved:
    """A checkpoint found: the directory with ``config.json`` and the weights path for the core
    loader (a directory, a file or an index)."""

    directory: Path
    weights: Path


def _variant(name: str, variant: str | None) -> str:
    if not variant:
        return name
    stem, dot, ext = name.partition(".")  # model.safetensors -> model.fp16.safetensors
    return f"{stem}.{variant}{dot}{ext}"


def _download_patterns(
    subfolder: str, variant: str | None, pickle: bool, remote_code: bool
) -> list[str]:
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    names = ["config.json", "generation_config.json"]
    for single, index in [(SINGLE_FILE, INDEX_FILE)] + (
        [(_PICKLE_SINGLE, _PICKLE_INDEX)] if pickle else []
    ):
        names += [_variant(single, variant), _variant(index, variant)]
        stem = _variant(single, variant).rsplit(".", 1)[0]
        names.append(f"{stem}-*-of-*.{single.rsplit('.', 1)[1]}")
    patterns = [prefix + n for n in names]
    if remote_code:
        patterns.append("*.py")
    return patterns


def is_local(name: str | os.PathLike[str]) -> bool:
    return Path(os.fspath(name)).exists()


def snapshot(
    repo_id: str,
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    pickle: bool = False,
    remote_code: bool = False,
) -> Path:
    """The local snapshot directory of ``repo_id`` (downloading only what a load needs)."""
    try:
        import huggingface_hub
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise FastloadIOError(
            f"{repo_id}: no such file or directory (and huggingface_hub, which resolves model ids, "
            "is not installed)"
        ) from None
    try:
        huggingface_hub.utils.validate_repo_id(repo_id)
    except HFValidationError:
        raise FastloadIOError(f"{repo_id}: no such file or directory") from None
    options = dict(hub)
    if huggingface_hub.constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "") in (
        "1",
        "ON",
        "YES",
        "TRUE",
    ):
        options["local_files_only"] = True
    if options.get("revision") is None:
        options.pop("revision", None)
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=_download_patterns(subfolder, variant, pickle, remote_code),
            library_name="fastload",
            **options,
        )
    except Exception as e:  # the hub's many error classes: not found, gated, offline, network
        where = "in the local cache" if options.get("local_files_only") else "on the hub"
        raise FastloadIOError(
            f"{repo_id}: not found {where} ({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from e
    return Path(path)


def resolve_checkpoint(
    name: str | os.PathLike[str],
    *,
    hub: dict[str, Any],
    subfolder: str = "",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    allow_pickle: bool = False,
    remote_code: bool = False,
) -> Resolved:
    """The local directory and weights of ``name``: a local path, or a model id."""
    path = Path(os.fspath(name))
    pickle = use_safetensors is False or (use_safetensors is None and allow_pickle)
    if not path.exists():
        path = snapshot(
            os.fspath(name),
            hub=hub,
            subfolder=subfolder,
            variant=variant,
            pickle=pickle,
            remote_code=remote_code,
        )
    elif hub.get("revision") not in (None, "main"):
        raise UnsupportedError(
            f"{path}: revision={hub['revision']!r} applies to model ids, not local directories"
        )
    if subfolder:
        path = path / subfolder
        if not path.exists():
            raise FastloadIOError(f"{path}: no such file or directory (subfolder={subfolder!r})")
    if path.is_file():
        return Resolved(path.parent, path)
    return Resolved(path, _weights(path, variant, use_safetensors))


def _weights(directory: Path, variant: str | None, use_safetensors: bool | None) -> Path:
    """The weights of a directory for a variant and a safetensors/pickle choice; the directory
    itself when the core's own choice (safetensors first) is the right one."""
    if use_safetensors is False:
        candidates = [_PICKLE_SINGLE, _PICKLE_INDEX]
    elif use_safetensors is True:
        candidates = [SINGLE_FILE, INDEX_FILE]
    else:
        candidates = [SINGLE_FILE, INDEX_FILE, _PICKLE_SINGLE, _PICKLE_INDEX]
    if not variant and use_safetensors is None:
        return directory
    for candidate in candidates:
        f = directory / _variant(candidate, variant)
        if f.is_file():
            return f
    wanted = " or ".join(_variant(c, variant) for c in candidates)
    raise CheckpointError(f"{directory}: no {wanted} in the directory")
