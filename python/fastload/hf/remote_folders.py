"""Local folders that stand for a prefix in object storage while another library's code runs on
them.

A pipeline read from ``s3://bucket/pipeline/`` (:mod:`fastload.diffusion.remote`) is loaded by
diffusers' own pipeline code, which knows local folders only: the pipeline's small files
(``model_index.json``, configs, scheduler and tokenizer files) are fetched into a temporary
folder, and diffusers calls each component's ``from_pretrained`` with a path inside it
(``<folder>/unet``). While :func:`serving` is active, the patched ``from_pretrained`` of
transformers (:mod:`fastload.hf.front`) and of diffusers look such a path up (:func:`lookup`) and
read the component from the URL it stands for (``s3://bucket/pipeline/unet``), with the pipeline's
``storage_options`` (and its ``process_group``, each component then a collective load): the
weights stream from the store, never through that folder. A component those patches would leave
to their library's own loader raises :func:`not_served` instead: that loader would see the folder
without weights.

The table is process-wide (a pipeline's components may be loaded from other threads), keyed by
the temporary folder's own path, which no other load shares.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.core.basics.errors import UnsupportedError

__all__ = ["RemoteFolder", "lookup", "not_served", "serving"]


@dataclass(frozen=True)
class RemoteFolder:
    """The URL a local path stands for, the ``storage_options`` to read it with, the
    ``process_group`` of the pipeline's collective load (``None``: not collective), and the
    ``component``: the path's folder in the pipeline (``"text_encoder"``; ``""`` for its root)."""

    url: str
    storage_options: Mapping[str, str] | None
    process_group: Any = None
    component: str = ""


_LOCK = threading.Lock()
_FOLDERS: dict[Path, RemoteFolder] = {}


def _key(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


@contextmanager
def serving(
    folder: str | os.PathLike[str],
    url: str,
    storage_options: Mapping[str, str] | None,
    process_group: Any = None,
) -> Iterator[None]:
    """While active, ``folder`` and every path inside it stand for ``url`` and the same path
    under it, read with ``storage_options`` by the ranks of ``process_group`` (if given)."""
    key = _key(folder)
    with _LOCK:
        _FOLDERS[key] = RemoteFolder(url.rstrip("/") + "/", storage_options, process_group)
    try:
        yield
    finally:
        with _LOCK:
            _FOLDERS.pop(key, None)


def lookup(path: object) -> RemoteFolder | None:
    """The URL the local ``path`` stands for (``<folder>/unet`` -> ``s3://.../unet/``), or
    ``None`` when it lies in no folder being served (or is not a path)."""
    if not isinstance(path, (str, os.PathLike)) or not _FOLDERS:
        return None
    if isinstance(path, str) and "://" in path:
        return None
    here = _key(path)
    with _LOCK:
        folders = dict(_FOLDERS)
    for folder, remote in folders.items():
        if here == folder or folder in here.parents:
            rest = here.relative_to(folder).as_posix()
            if rest == ".":
                return remote
            return dataclasses.replace(remote, url=f"{remote.url}{rest}/", component=rest)
    return None


def not_served(cls: type, remote: RemoteFolder, reason: str, library: str) -> UnsupportedError:
    """The error for a component of a pipeline read from object storage that fastload does not
    serve (``reason``), which ``library``'s own loader cannot read either: it names the
    component, its URL and why."""
    component = remote.component or "the pipeline's root"
    return UnsupportedError(
        f"{component} ({cls.__name__}) of the pipeline at {remote.url}: fastload does not serve "
        f"this load ({reason}), and {library} itself cannot read object storage; load that "
        "component from a local copy and pass it to from_pretrained"
    )
