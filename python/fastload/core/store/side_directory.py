"""The temporary directory a load from object storage fetches a checkpoint's small files into
(``config.json``, an index, a generation config), beside the weights it streams.

A process that is killed mid-load (the OOM killer, ``SIGKILL``, a node draining) cannot remove
its own, so the directory's name carries the process's id and pid namespace, and each new one
first removes those of processes of the same namespace that are gone. A directory of a live
process, of another namespace (a container sharing ``/tmp``), of another user or named otherwise
is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["PREFIX", "side_files_directory"]

#: the start of every side-files directory's name under the temporary directory
PREFIX = "fastload-side-files-"


def side_files_directory() -> tempfile.TemporaryDirectory[str]:
    """A new side-files directory under ``tempfile.gettempdir()``, removed when closed (its
    name: :data:`PREFIX`, the pid namespace, the process id), after removing those that processes
    now gone left behind."""
    space = _namespace()
    _remove_left_behind(Path(tempfile.gettempdir()), space)
    return tempfile.TemporaryDirectory(prefix=f"{PREFIX}{space}-{os.getpid()}-")


def _namespace() -> str:
    """This process's pid namespace (its inode number; ``host`` where ``/proc`` cannot say)."""
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "host"
    except OSError:
        return "host"


def _remove_left_behind(root: Path, space: str) -> None:
    try:
        names = [e.name for e in os.scandir(root) if e.name.startswith(f"{PREFIX}{space}-")]
    except OSError:
        return  # nothing to tidy where the directory cannot be listed
    uid = os.getuid()
    for name in names:
        pid = name[len(PREFIX) + len(space) + 1 :].partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = root / name
        try:
            if path.lstat().st_uid != uid or not path.is_dir() or path.is_symlink():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)  # another process may be removing it too


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True
