"""One object version for every rank of a collective load from object storage.

Each rank opens the checkpoint's objects itself, and the engine pins each rank's reads to the
version its open saw (``If-Match`` its ETag, else ``If-Unmodified-Since`` its date; see
``fastload._core.SafetensorsFile.version``). The chunks one rank fetches go to every rank, so the
ranks must have opened the same version: :func:`agree_on_versions` compares the versions across
the group before the first tensor byte is fetched. Two URLs may name one version (each node's
replica of a bucket): the ETag (with the size) identifies it. Without ETags only the same URL
with the same size and date is taken as the same version.

An object replaced after every rank opened it cannot mix versions either: the fetch of a rank
pinned to the old version fails (``CheckpointError [object-changed]``), and the exchange stops
every rank with that error (:mod:`fastload.distributed.group`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastload.core.basics.errors import CheckpointError
from fastload.distributed.group import RankGroup

#: (URL or path, (size, ETag, Last-Modified) or None for a local file) of each file of a rank
Versions = list[tuple[str, "tuple[int, str | None, str | None] | None"]]


def versions_of(files: Sequence[Any]) -> Versions:
    """The version each of ``files`` is read at (``None`` for a local file)."""
    return [(f.path, getattr(f, "version", None)) for f in files]


def agree_on_versions(group: RankGroup, files: Sequence[Any]) -> None:
    """``CheckpointError`` on every rank unless every rank reads the same version of each file
    (or every rank reads local files, which :func:`~fastload.distributed.collective.
    check_same_checkpoint` compares by their headers), naming the files, ranks and versions."""
    everyone: list[Versions] = group.gather(versions_of(files))
    if all(v is None for rank in everyone for _, v in rank):
        return
    if len({len(listed) for listed in everyone}) > 1:  # a sharded prefix here, one shard there
        listed = "; ".join(
            f"rank {r}: {len(files)} file(s): {', '.join(path for path, _ in files)}"
            for r, files in enumerate(everyone)
        )
        raise CheckpointError(
            f"collective load: the ranks opened checkpoints of different numbers of files "
            f"({listed}); every rank must read one version of the checkpoint [version-mismatch]"
        )
    for index in range(len(everyone[0])):
        seen = [(rank, listed[index]) for rank, listed in enumerate(everyone)]
        problem = _disagreement([entry for _, entry in seen])
        if problem is not None:
            listed = "; ".join(f"rank {r}: {_describe(path, v)}" for r, (path, v) in seen)
            raise CheckpointError(
                f"collective load: the ranks opened {problem} ({listed}); every rank must read "
                "one version of the checkpoint [version-mismatch]"
            )


def _disagreement(entries: list[tuple[str, Any]]) -> str | None:
    """What differs between the ranks' ``(path, version)`` of one file, or None."""
    versions = [v for _, v in entries]
    if any(v is None for v in versions):
        return "a file of the checkpoint from object storage on some ranks and locally on others"
    if all(etag is not None for _, etag, _ in versions):
        if len({(size, etag) for size, etag, _ in versions}) > 1:
            return "different versions of an object (their ETags or sizes differ)"
        return None
    if len({(path, tuple(v)) for path, v in entries}) > 1:
        return (
            "objects without an ETag at different URLs, or at different sizes or dates (only "
            "an ETag tells that two URLs hold one version)"
        )
    return None


def _describe(path: str, version: tuple[int, str | None, str | None] | None) -> str:
    if version is None:
        return f"{path} (a local file)"
    size, etag, date = version
    return f"{path} ({size} bytes, ETag {etag or 'none'}, Last-Modified {date or 'none'})"


__all__ = ["Versions", "agree_on_versions", "versions_of"]
