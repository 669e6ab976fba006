"""Small files written beside their final name and renamed into place, safely in a directory other
users or a hostile source may have written to: the side files ``fastload fetch`` and remote
``from_pretrained`` copy, the companions ``fastload convert`` copies.

A temporary is created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a link planted at its name, dangling or
not, is refused, never followed out of the directory) under a short random name (``.fastload-``
and 8 hex digits, ``.partial``: 26 bytes, whatever the length of the final name, so a final name
of up to 255 bytes has one), and the rename replaces the directory entry, never what a link there
points to. Safetensors saves write their own temporaries the same way, in Rust
(``create_new``: ``O_EXCL``).

A temporary is removed when its write fails or is interrupted (Ctrl-C, and SIGTERM in the command
line, which raise in Python). A process killed outright (SIGKILL, the OOM killer, a power cut)
leaves it, and :func:`sweep` removes such leftovers: the writer holds an advisory lock
(``flock``) on each temporary from its creation to its rename, which the kernel drops when the
process dies, so a temporary nobody holds is a leftover, and one being written is never touched,
whichever process, or machine sharing the filesystem, writes it. Where the filesystem has no such
locks, nothing is swept.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; temporaries are still removed on failure, never swept
    fcntl = None  # type: ignore[assignment]

#: how the temporaries are named: hidden, and never ``*.safetensors`` or ``*.json``
PREFIX, SUFFIX = ".fastload-", ".partial"
_NAME = re.compile(re.escape(PREFIX) + "[0-9a-f]{8}" + re.escape(SUFFIX))

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
_FLAGS |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
# a sweep opens what it finds without following a link or blocking on a FIFO planted there
_SWEEP_FLAGS = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_SWEEP_FLAGS |= getattr(os, "O_CLOEXEC", 0)

#: the temporaries this process is writing, and the descriptor holding each one's lock
_held: dict[Path, int] = {}
_held_lock = threading.Lock()


def _locked(fd: int, path: Path) -> bool:
    """Takes the lock of the new temporary ``fd`` at ``path``; ``False`` where a sweep took it
    first (between the creation and the lock), which removes the file."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:  # no locks on this filesystem: nothing sweeps there either
            pass
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


def write_temporary(directory: Path, data: bytes) -> Path:
    """``data`` in a new file of ``directory`` under a fresh temporary name (mode ``0o666`` less
    the umask, as any file the user creates), flushed to disk; its path. Removed again if the
    write fails. The file stays locked against :func:`sweep` until :func:`publish` or
    :func:`discard` is called with it (one of them must be)."""
    for _ in range(100):
        path = directory / f"{PREFIX}{secrets.token_hex(4)}{SUFFIX}"
        try:
            fd = os.open(path, _FLAGS, 0o666)
        except FileExistsError:  # taken (or a link planted there): another name
            continue
        if _locked(fd, path):
            break
        os.close(fd)  # swept before it was locked: another name
    else:
        raise FileExistsError(f"{directory}: no free temporary name after 100 tries")
    with _held_lock:
        _held[path] = fd
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        discard([path])
        raise
    return path


def _release(path: Path) -> None:
    with _held_lock:
        fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def discard(paths: Iterable[Path]) -> None:
    """Removes temporaries after a failure (the failure is the error to report, not this)."""
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
        _release(path)


def publish(temporary: Path, target: Path) -> Path:
    """Renames ``temporary`` over ``target`` (a link at ``target`` is replaced, not followed);
    ``target``."""
    try:
        os.replace(temporary, target)
    finally:
        _release(temporary)
    return target


def sweep(directory: Path) -> list[Path]:
    """Removes the temporaries in ``directory`` that no process is writing: those a process
    killed before it renamed them left behind (their lock went with it). A temporary being
    written, by any process, is left alone, and so is anything of another name, or not a
    regular file, or that cannot be opened, locked or removed. Returns the paths removed."""
    if fcntl is None:
        return []
    try:
        names = [e.name for e in os.scandir(directory) if _NAME.fullmatch(e.name)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = directory / name
        try:
            fd = os.open(path, _SWEEP_FLAGS)
        except OSError:  # a link, a directory, another user's file, gone meanwhile
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: its writer is alive
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


__all__ = ["PREFIX", "SUFFIX", "discard", "publish", "sweep", "write_temporary"]
