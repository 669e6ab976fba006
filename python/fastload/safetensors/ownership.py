"""Who owns a save's temporary files: a file lock, not a process id.

Every temporary thing a save creates (``save_pretrained``'s staging directory, ``save_file``'s
temporary file) has a lock file beside it, ``<item name>.lock``, that the save holds locked
(``flock``, exclusive) for as long as the item may be in use. Another save finds leftovers of
killed saves by trying the lock: if it can take it, the owner is gone (the kernel or the NFS
lock manager released the lock when the process died), and the item and its lock file are
removed. A process id would not tell: two containers sharing a volume, or two hosts on NFS,
cannot see each other's processes, and a pid is reused.

Order of operations, so that an owned item is never without its held lock: the lock file is
created under a temporary name, locked, and renamed into place before the item is created; the
owner removes the item before the lock file. An item whose lock file is missing is therefore
never live: it is a leftover (or from a fastload without these locks) and is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path

LOCK_SUFFIX = ".lock"
PENDING_SUFFIX = ".pending-lock"
#: names of lock files still being created (``.<12 hex>.pending-lock``)
PENDING_RE = re.compile(r"^\.[0-9a-f]{12}\.pending-lock$")
# Lock files this process holds (on NFS, flock is emulated with POSIX locks, which a second
# open in the same process would neither block nor keep: never probe our own).
_HELD: set[str] = set()


def lock_path(item: Path) -> Path:
    """The lock file of ``item``."""
    return item.with_name(item.name + LOCK_SUFFIX)


class OwnerLock:
    """The held lock of one temporary item; :meth:`release` after the item is gone."""

    def __init__(self, item: Path) -> None:
        self.path = lock_path(item)
        for attempt in range(3):
            pending = item.with_name(f".{secrets.token_hex(6)}{PENDING_SUFFIX}")
            fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.rename(pending, self.path)  # appears already locked
                break
            except FileNotFoundError:
                # A sweep removed the pending file between its creation and the lock: again.
                os.close(fd)
                if attempt == 2:
                    raise
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(pending)
                raise
        self._fd: int | None = fd
        _HELD.add(os.fspath(self.path))

    def release(self) -> None:
        """Removes the lock file, then unlocks (the item must already be gone)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        _HELD.discard(os.fspath(self.path))
        os.close(self._fd)
        self._fd = None


def remove_if_abandoned(item: Path) -> bool:
    """Removes ``item`` (file or directory tree) and its lock file if no live save holds the
    lock; returns whether it did. Never waits."""
    lock = lock_path(item)
    if os.fspath(lock) in _HELD:
        return False
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ENOENT:
            return False  # cannot tell: leave it
        _remove(item)  # no lock file: not a live save's (see the module docstring)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # held: a save is using it
        _remove(item)
        with contextlib.suppress(OSError):
            os.unlink(lock)
        return True
    finally:
        os.close(fd)


def sweep(directory: Path, items: re.Pattern[str]) -> int:
    """Removes from ``directory`` the abandoned items whose names match ``items``, their orphaned
    lock files, and lock files a killed save was still creating; returns how many items (or
    orphaned locks) went. Entries a live save holds are left alone."""
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it]
    except OSError:
        return 0
    removed = 0
    candidates = set()
    for name in names:
        if PENDING_RE.match(name):
            _remove_pending(directory / name)
        elif name.endswith(LOCK_SUFFIX) and items.match(name[: -len(LOCK_SUFFIX)]):
            candidates.add(name[: -len(LOCK_SUFFIX)])
        elif items.match(name):
            candidates.add(name)
    for name in sorted(candidates):
        removed += remove_if_abandoned(directory / name)
    return removed


def _remove_pending(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(OSError):
            os.unlink(path)
    except OSError:
        pass  # held: a save is creating its lock
    finally:
        os.close(fd)


def _remove(item: Path) -> None:
    if item.is_dir() and not item.is_symlink():
        shutil.rmtree(item, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            item.unlink()
