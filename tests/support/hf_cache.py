"""A Hugging Face hub cache built on disk, as huggingface_hub lays it out, for offline tests.

``models--{org}--{name}/blobs/<sha256>`` holds each file once, ``refs/<revision>`` the commit
hash, ``snapshots/<commit>/<path>`` a relative symlink to the blob. Tests then resolve model ids
with ``cache_dir=`` (or ``HF_HUB_CACHE``) and ``HF_HUB_OFFLINE=1``: nothing reaches a network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(
    cache: Path,
    repo_id: str,
    files: dict[str, Path | bytes],
    *,
    revision: str = "main",
    commit: str | None = None,
) -> Path:
    """Puts ``files`` (repo path -> a file to copy, or bytes) in the cache as the snapshot of
    ``revision`` (a commit hash derived from the contents unless given); returns the snapshot
    directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, refs = repo / "blobs", repo / "refs"
    blobs.mkdir(parents=True, exist_ok=True)
    refs.mkdir(parents=True, exist_ok=True)
    contents = {k: (v.read_bytes() if isinstance(v, Path) else v) for k, v in files.items()}
    digest = hashlib.sha1()
    for key in sorted(contents):
        digest.update(key.encode() + hashlib.sha256(contents[key]).digest())
    commit = commit or digest.hexdigest()
    snapshot = repo / "snapshots" / commit
    for name, data in contents.items():
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (refs / revision).write_text(commit)
    return snapshot


def directory_files(directory: Path, prefix: str = "") -> dict[str, Path | bytes]:
    """Every file under ``directory`` keyed by its repo path (under ``prefix``)."""
    return {
        prefix + p.relative_to(directory).as_posix(): p
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
