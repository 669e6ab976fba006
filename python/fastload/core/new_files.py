"""Small files written beside their final name and renamed into place, safely in a directory other
users or a hostile source may have written to: the side files ``fastload fetch`` and remote
``from_pretrained`` copy, the companions ``fastload convert`` copies.

A temporary is created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a link planted at its name, dangling or
not, is refused, never followed out of the directory) under a short random name (``.fastload-``
and 8 hex digits, ``.partial``: 26 bytes, whatever the length of the final name, so a final name
of up to 255 bytes has one), and the rename replaces the directory entry, never what a link there
points to. Safetensors saves write their own temporaries the same way, in Rust
(``create_new``: ``O_EXCL``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

#: how the temporaries are named: hidden, and never ``*.safetensors`` or ``*.json``
PREFIX, SUFFIX = ".fastload-", ".partial"

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def write_temporary(directory: Path, data: bytes) -> Path:
    """``data`` in a new file of ``directory`` under a fresh temporary name (mode ``0o666`` less
    the umask, as any file the user creates), flushed to disk; its path. Removed again if the
    write fails."""
    for _ in range(100):
        path = directory / f"{PREFIX}{secrets.token_hex(4)}{SUFFIX}"
        try:
            fd = os.open(path, _FLAGS, 0o666)
        except FileExistsError:  # taken (or a link planted there): another name
            continue
        break
    else:
        raise FileExistsError(f"{directory}: no free temporary name after 100 tries")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        discard([path])
        raise
    return path


def discard(paths: Iterable[Path]) -> None:
    """Removes temporaries after a failure (the failure is the error to report, not this)."""
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def publish(temporary: Path, target: Path) -> Path:
    """Renames ``temporary`` over ``target`` (a link at ``target`` is replaced, not followed);
    ``target``."""
    os.replace(temporary, target)
    return target


__all__ = ["PREFIX", "SUFFIX", "discard", "publish", "write_temporary"]
