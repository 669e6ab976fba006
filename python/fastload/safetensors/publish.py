"""Putting written files in place crash-safely: a single file, or a whole checkpoint directory.

A file is written under a hidden temporary name in its final directory (never ending in
``.safetensors``, so no loader picks up a half-written one), fsynced, renamed over the final
name, and the directory fsynced: a rename is a directory write, durable only then.

A checkpoint directory is built in a hidden staging directory beside it
(``.fastload-<name>.<pid>-<random>.tmp``); the target's other files (tokenizer, README,
sub-directories) are hard-linked into it (copied where linking fails) and the two directories are
exchanged in one ``renameat2(RENAME_EXCHANGE)``, so that several shards are replaced together and
a crash leaves the complete old or the complete new tree. Where the exchange is unavailable (not
Linux, a C library, kernel or filesystem without it, a mount point, an unwritable parent) the
files are renamed in one by one, the index last, with a warning; stale weight files of earlier
saves are then removed, the index first.

Every temporary file and staging directory carries an ownership lock
(:mod:`fastload.safetensors.ownership`), so the next save removes what a killed save left and never
what a live one, in any process, container or host, is still using.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastload.core.basics.errors import FastloadIOError, from_os_error
from fastload.core.checkpoint.files import INDEX_FILE as INDEX_NAME
from fastload.core.checkpoint.files import SINGLE_FILE as WEIGHTS_NAME
from fastload.safetensors import ownership

logger = logging.getLogger("fastload")

#: Linux ``renameat2`` flag: exchange the two paths atomically (both must exist).
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# The ownership locks of the staging directories this process is using now.
_STAGING_LOCKS: dict[str, ownership.OwnerLock] = {}
# Temporary names of per-file writes (see temp_path) left by a killed save.
TEMP_FILE_RE = re.compile(r"^\.(?P<final>.+)\.\d+-[0-9a-f]{8}\.tmp$")


# --- single files ---------------------------------------------------------------------------------


#: the most bytes a file name may have (NAME_MAX on Linux, macOS and Windows filesystems)
NAME_MAX = 255


def temp_path(directory: Path, final_name: str) -> Path:
    """A hidden name for writing ``final_name`` in ``directory``: ending in .tmp, so a loader
    globbing *.safetensors never sees it. The final name in it is cut (its first bytes kept)
    where the temporary name and its ownership lock would pass ``NAME_MAX``: any name a file may
    have can be saved."""
    suffix = f".{os.getpid()}-{secrets.token_hex(4)}.tmp"
    room = NAME_MAX - 1 - len(suffix) - len(ownership.LOCK_SUFFIX)
    encoded = os.fsencode(final_name)
    if len(encoded) > room:
        final_name = os.fsdecode(encoded[:room])
    return directory / f".{final_name}{suffix}"


def remove_stale_temp_files(directory: Path) -> None:
    """Deletes the temporary files (:func:`temp_path`) that killed saves left in ``directory``:
    those whose ownership lock is free; a running save's stay."""
    ownership.sweep(directory, TEMP_FILE_RE)


def own_temp(item: Path, final: Path) -> ownership.OwnerLock:
    """The lock that marks ``item``, a temporary file of the save to ``final``, as this save's
    (see :mod:`fastload.safetensors.ownership`); errors name ``final``."""
    try:
        return ownership.OwnerLock(item)
    except OSError as e:
        raise from_os_error(e, final) from e


def fsync_dir(directory: Path) -> None:
    """Makes the renames in ``directory`` durable (a rename is a directory write)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories have nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Makes ``path``'s bytes durable before a rename publishes it (files written by Python, not
    by the Rust writer, which fsyncs its own)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def remove_quietly(path: Path) -> None:
    """Cleanup after a failure: the original error is the one to report, not this one's."""
    with contextlib.suppress(OSError):
        path.unlink()


def replace_file(tmp: Path, final: Path) -> None:
    """Renames the written ``tmp`` over ``final`` (atomic on POSIX: a reader sees the old file or
    the new one); on failure ``tmp`` is removed and the error names ``final``."""
    try:
        os.replace(tmp, final)
    except OSError as exc:
        remove_quietly(tmp)
        raise from_os_error(exc, final, "cannot move the written file into place") from exc


# --- checkpoint directories -----------------------------------------------------------------------


def _staging_pattern(target_name: str | None) -> re.Pattern[str]:
    """Names of staging directories: ``.fastload-<target name>.<pid>-<hex>.tmp`` beside the
    target, ``.fastload-<pid>-<hex>.tmp`` inside it (the fallback)."""
    middle = re.escape(target_name) + r"\." if target_name is not None else ""
    return re.compile(rf"^\.fastload-{middle}(?P<pid>\d+)-[0-9a-f]{{8}}\.tmp$")


_INNER_STAGING_RE = _staging_pattern(None)


def _is_weight_file(name: str) -> bool:
    return name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(name) is not None


def remove_stale_staging(target: Path) -> None:
    """Deletes staging directories that killed saves to ``target`` left behind: those whose
    ownership lock is free (:mod:`fastload.safetensors.ownership`); a running save's are left
    alone, in this or any other process, container or host sharing the filesystem."""
    ownership.sweep(target.parent, _staging_pattern(target.name))
    ownership.sweep(target, _INNER_STAGING_RE)


def _mkdir_staging(place: Path, target_name: str | None) -> Path:
    # The pid in the name only helps a person reading the directory; the lock decides.
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    name = f".fastload-{tag}.tmp" if target_name is None else f".fastload-{target_name}.{tag}.tmp"
    path = place / name
    lock = ownership.OwnerLock(path)
    try:
        os.mkdir(path, 0o777)  # the umask applies, as for any directory the user creates
    except BaseException:
        lock.release()
        raise
    _STAGING_LOCKS[os.fspath(path)] = lock
    return path


def drop_staging(staging: Path) -> None:
    """Deletes a staging directory of this process, then gives up its lock."""
    shutil.rmtree(staging, ignore_errors=True)
    lock = _STAGING_LOCKS.pop(os.fspath(staging), None)
    if lock is not None:
        lock.release()


def make_staging(target: Path) -> tuple[Path, bool]:
    """A new, empty, hidden directory to write the checkpoint into, and whether it can replace
    ``target`` whole (a sibling on the same filesystem, where the exchange works)."""
    parent = target.parent
    exists = target.is_dir()
    if not exists:
        parent.mkdir(parents=True, exist_ok=True)
    elif parent == target or os.stat(parent).st_dev != os.stat(target).st_dev:
        # The root, or a mount point (a container volume): it cannot be renamed.
        _warn_file_by_file(target, "it is a mount point")
        return _mkdir_staging(target, None), False
    try:
        staging = _mkdir_staging(parent, target.name)
    except OSError as exc:
        if not exists:
            raise
        _warn_file_by_file(target, f"cannot create a directory beside it: {exc.strerror or exc}")
        return _mkdir_staging(target, None), False
    if not exists:
        return staging, True
    try:
        problem = _exchange_problem(staging)
    except BaseException:
        drop_staging(staging)
        raise
    if problem is not None:
        _warn_file_by_file(target, problem)
    return staging, problem is None


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2`` (glibc >= 2.28), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> None:
    """Atomically swaps the directory entries ``a`` and ``b`` (both must exist)."""
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available on this platform")
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def _exchange_problem(staging: Path) -> str | None:
    """Why two directories of ``staging``'s filesystem cannot be exchanged, or ``None``: tried on
    two empty directories inside it before anything is written."""
    a, b = staging / "a", staging / "b"
    try:
        a.mkdir()
        b.mkdir()
        _exchange(a, b)
    except OSError as exc:
        return f"renameat2(RENAME_EXCHANGE) failed: {exc.strerror or exc}"
    finally:
        for d in (a, b):
            with contextlib.suppress(OSError):
                d.rmdir()
    return None


def _warn_file_by_file(target: Path, reason: str) -> None:
    logger.warning(
        "%s: the checkpoint directory cannot be replaced in one step (%s); its files are renamed "
        "into place one by one, the index last, so a crash during those renames can leave a mix "
        "of old and new shards",
        target,
        reason,
    )


def _link_tree(source: str, dest: str, skip: Callable[[str], bool], device: int) -> None:
    """Recreates the entries of directory ``source`` in ``dest`` (except names ``skip`` accepts):
    files as hard links (copies where linking fails), symlinks as symlinks, directories anew.
    Raises ``OSError`` for anything it cannot reproduce faithfully (a fifo, a socket, a mounted
    filesystem inside), so the caller can publish another way instead of losing it."""
    with os.scandir(source) as it:
        entries = list(it)
    for entry in entries:
        if skip(entry.name):
            continue
        dst = os.path.join(dest, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), dst)
        elif entry.is_dir(follow_symlinks=False):
            if entry.stat(follow_symlinks=False).st_dev != device:
                raise OSError(errno.EXDEV, "a filesystem is mounted there", entry.path)
            os.mkdir(dst)
            _link_tree(entry.path, dst, lambda _: False, device)
            _copy_metadata(entry.path, dst)
            fsync_dir(Path(dst))
        elif entry.is_file(follow_symlinks=False):
            try:
                os.link(entry.path, dst, follow_symlinks=False)
            except OSError:  # no hard links here, a link limit, or protected_hardlinks
                shutil.copy2(entry.path, dst, follow_symlinks=False)
                _copy_metadata(entry.path, dst)
                fsync_file(Path(dst))
        else:
            raise OSError(errno.EOPNOTSUPP, "not a file, directory or symlink", entry.path)


def _copy_metadata(source: str | Path, dest: str | Path) -> None:
    """Mode, times, extended attributes (ACLs) and, where permitted, owner of ``source``."""
    shutil.copystat(source, dest, follow_symlinks=False)
    st = os.stat(source, follow_symlinks=False)
    if hasattr(os, "chown"):
        with contextlib.suppress(OSError):  # only root may give a file away
            os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)


def swap_into_place(staging: Path, target: Path, written: set[str]) -> bool:
    """Makes ``staging`` the checkpoint directory in one atomic step; returns ``False`` (having
    warned) when it cannot, with ``target`` untouched. Afterwards ``staging`` names the old
    tree."""
    if not target.exists():
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
            # Created meanwhile: exchange with it like with any existing directory.
        else:
            fsync_dir(target.parent)
            return True

    def owned(name: str) -> bool:
        # What this save writes, every weight file of earlier saves, leftovers of killed saves
        # and the ownership locks of any save (never carried into the new tree).
        if ownership.PENDING_RE.match(name):
            return True
        if name.endswith(ownership.LOCK_SUFFIX):
            base = name[: -len(ownership.LOCK_SUFFIX)]
            return bool(_INNER_STAGING_RE.match(base) or TEMP_FILE_RE.match(base))
        temp = TEMP_FILE_RE.match(name)
        return (
            name in written
            or _is_weight_file(name)
            or _INNER_STAGING_RE.match(name) is not None
            or (temp is not None and (_is_weight_file(temp["final"]) or temp["final"] in written))
        )

    for name in os.listdir(target):
        path = target / name
        if (name in written or _is_weight_file(name)) and path.is_dir() and not path.is_symlink():
            raise FastloadIOError(f"{path}: is a directory; the save would replace it")
    try:
        _link_tree(os.fspath(target), os.fspath(staging), owned, os.stat(target).st_dev)
        _copy_metadata(target, staging)
        os.utime(staging)  # the save is a change of the directory
        fsync_dir(staging)
    except OSError as exc:
        _warn_file_by_file(target, f"cannot carry over {exc.filename}: {exc.strerror or exc}")
        return False
    cwd = _cwd_within(target)
    try:
        _exchange(staging, target)
    except OSError as exc:
        _warn_file_by_file(target, f"renameat2(RENAME_EXCHANGE) failed: {exc.strerror or exc}")
        return False
    fsync_dir(target.parent)
    if cwd is not None:
        # This process's working directory was in the old tree, which is about to be deleted.
        with contextlib.suppress(OSError):
            os.chdir(cwd)
    return True


def _cwd_within(target: Path) -> str | None:
    try:
        cwd = os.getcwd()
    except OSError:
        return None
    real = os.path.realpath(cwd)
    inside = real == os.fspath(target) or real.startswith(os.path.join(os.fspath(target), ""))
    return cwd if inside else None


def publish_file_by_file(staging: Path, target: Path, written: list[str], sharded: bool) -> None:
    """The fallback: each file renamed from ``staging`` into ``target`` in ``written`` order
    (config, shards, the index last), then stale weight files of earlier saves removed."""
    for name in written:
        replace_file(staging / name, target / name)
    fsync_dir(target)
    _remove_stale(target, set(written), sharded)


def _remove_stale(directory: Path, written: set[str], sharded: bool) -> None:
    """Deletes the weight files of an earlier save that the new one did not overwrite; runs after
    the new files (and index) are in place, so a crash in between leaves a loadable checkpoint."""
    stale = [
        entry
        for entry in directory.iterdir()
        if entry.name not in written
        and entry.is_file()
        and (
            _SHARD_RE.match(entry.name)
            or (sharded and entry.name == WEIGHTS_NAME)
            or (not sharded and entry.name == INDEX_NAME)
        )
    ]
    # The index goes first: shards without an index are never read, an index without shards is.
    for entry in sorted(stale, key=lambda e: e.name != INDEX_NAME):
        entry.unlink()
    if stale:
        fsync_dir(directory)
