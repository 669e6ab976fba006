"""Loads that belong together: one read-ahead over all their files, one progress bar.

A caller that makes several loads in a row (the models of one bundle, loaded one after another
by a library the caller does not control) opens a :class:`LoadSession` over every file those
loads will read and makes the loads inside it (``with session:``). The session:

* reads ahead every file from the start, in the order given (the order the loads come), in one
  helper thread: the disk works on the third model while the first one's skeleton is built. A
  file whose load makes views of it is mapped as it is read; any other is read into the page
  cache only, so a load that copies (converts) holds no mapping of its file beside its new
  tensors (:mod:`fastload.core.reads.session_files`). What each load makes of its files, the
  caller says where it knows (``dtypes``) and each load says when it opens them.
  Within the read-ahead room of the memory budget
  (:meth:`~fastload.core.memory.budget.MemoryBudget.read_ahead_room`): the files that fit, in
  order, and none past the first that does not (its load then reads ahead what fits itself, as a
  load alone does);
* draws one progress bar over the bytes of all the files, which the read-ahead and every load's
  copies advance (a load inside a session draws no bar of its own).

Each load finds the session of its context (:func:`current_session`, a context variable: loads in
other threads are not part of it) when it opens its checkpoint and takes its part
(:meth:`LoadSession.part`): the mappings the session made of its files, already read (or being
read) and mapped, from which its views come (:class:`~fastload.core.memory.sharing.SharedMapping`,
the same as a load's own read-ahead makes), a warm-up of its own for files the session does not
hold, and its share of the bar. A file is matched by identity (device, inode and size), so a file
replaced since the session opened it is read by the load as usual.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fastload import _core
from fastload.core.basics.dtypes import main_floating_dtype
from fastload.core.basics.progress import bar_wanted, open_bar
from fastload.core.memory.budget import MemoryBudget, memory_budget
from fastload.core.memory.sharing import SharedMapping, WarmUp, file_sharing
from fastload.core.reads.session_files import AheadFile

__all__ = ["LoadSession", "PartWarmUp", "SessionPart", "current_session", "part_of"]

_CURRENT: contextvars.ContextVar[LoadSession | None] = contextvars.ContextVar(
    "fastload_load_session", default=None
)

#: ``(device, inode, size)`` of a file
_Key = tuple[int, int, int]


def current_session() -> LoadSession | None:
    """The session the loads of this context belong to (``None``: each load on its own)."""
    return _CURRENT.get()


def _key(file: object) -> _Key | None:
    if not isinstance(file, _core.SafetensorsFile) or file.remote:
        return None
    identity = file.identity()
    return None if identity is None else (*identity, file.file_size)


def part_of(files: Sequence[object], *, alone: bool = False) -> SessionPart | None:
    """The part of a load of ``files`` (its checkpoint's, opened) in the session of its context;
    ``None`` outside a session, or ``alone`` (a load whose ranks read together)."""
    session = current_session()
    return None if session is None or alone else session.part(files)


class LoadSession:
    """Loads that belong together, over the safetensors files at ``paths`` (in the order the
    loads read them): one read-ahead of them all, within the memory budget, and one progress
    bar (``progress``: drawn when :func:`~fastload.core.basics.progress.bar_wanted` says so;
    ``desc``: its label). ``mmap`` decides which files may be mapped
    (:func:`~fastload.core.memory.sharing.file_sharing`). Files that cannot be opened are left to
    their loads, which report them. Use it as a context manager around the loads."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]],
        *,
        mmap: str = "auto",
        progress: bool = True,
        desc: str = "fastload",
        budget: MemoryBudget | None = None,
        dtypes: Mapping[str | os.PathLike[str], torch.dtype] | None = None,
    ) -> None:
        # the dtype each file's load will ask for, where the caller knows it: a file stored
        # mostly in it will be views, so the helper maps it as it reads it; any other, copies
        wanted = {os.fspath(p): d for p, d in (dtypes or {}).items()}
        self.budget = budget or memory_budget()
        files: dict[_Key, _core.SafetensorsFile] = {}
        views: dict[_Key, bool | None] = {}
        for path in paths:
            try:
                file = _core.SafetensorsFile(os.fspath(path), "pread")
            except (OSError, ValueError):
                continue
            key = _key(file)
            if key is not None and key not in files:
                files[key] = file
                want = wanted.get(os.fspath(path))
                views[key] = None if want is None else want == _stored_dtype(file)
        #: bytes of tensor data of every file, and those the bar shows as done, per file
        self.sizes = {k: f.file_size - f.data_start for k, f in files.items()}
        self._shown: dict[_Key, int] = dict.fromkeys(files, 0)
        room = self.budget.read_ahead_room()
        self._ahead: dict[_Key, AheadFile] = {}
        for key, file in files.items():
            if room is not None and self.sizes[key] > room:
                break  # the rest in the order of the loads: each load reads ahead what fits
            if not file_sharing(file, mmap)[0]:
                continue
            self._ahead[key] = AheadFile(SharedMapping(file), views[key])
            room = None if room is None else room - self.sizes[key]
        self.total = sum(self.sizes.values())
        self._lock = threading.Lock()
        self._bar: Any = open_bar(self.total, desc) if bar_wanted(self.total, progress) else None
        self._unit = 1
        if self._bar is not None:
            self._unit = self._bar.fastload_unit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token: contextvars.Token[LoadSession | None] | None = None

    @property
    def drawn(self) -> bool:
        """Whether the session draws its progress bar."""
        return self._bar is not None

    @property
    def read_ahead(self) -> list[str]:
        """The paths of the files the session reads ahead."""
        return [a.mapping.path for a in self._ahead.values()]

    def __enter__(self) -> LoadSession:
        self._token = _CURRENT.set(self)
        if self._ahead:
            self._thread = threading.Thread(
                target=self._run, name="fastload-session-read-ahead", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        self._stop.set()  # the pieces under way finish; a file no load took is left
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for ahead in self._ahead.values():
            ahead.read.set()
        self._ahead.clear()  # mappings no view holds are unmapped
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _run(self) -> None:
        # by key, not holding the files: a file whose load is over is let go (part.done)
        for key in list(self._ahead):
            ahead = self._ahead.get(key)
            if self._stop.is_set():
                return
            if ahead is not None:
                ahead.run(lambda n, key=key: self._advance(key, n), self._stop)
                del ahead

    def _advance(self, key: _Key, nbytes: int) -> None:
        """Moves the bar by ``nbytes`` of file ``key`` (never past the file's size)."""
        with self._lock:
            step = max(0, min(nbytes, self.sizes[key] - self._shown[key]))
            self._shown[key] += step
            if step and self._bar is not None:
                self._bar.update(step / self._unit)

    def part(self, files: Sequence[object]) -> SessionPart:
        """The part of one load that reads ``files`` (its checkpoint's opened files)."""
        return SessionPart(self, [_key(f) for f in files])


def _stored_dtype(file: _core.SafetensorsFile) -> torch.dtype | None:
    """The floating dtype holding most of ``file``'s bytes (``None``: none is floating)."""
    return main_floating_dtype(
        (st_dtype, end - begin) for _, st_dtype, _, begin, end in file.tensors()
    )


class SessionPart:
    """One load's part in a :class:`LoadSession`: the mappings of its files the session holds,
    the warm-up of its files it does not hold, and its share of the progress bar."""

    def __init__(self, session: LoadSession, keys: list[_Key | None]) -> None:
        self.session = session
        self.keys = keys
        self.held = {i: session._ahead[k] for i, k in enumerate(keys) if k in session._ahead}
        self.warm_up: WarmUp | None = None

    def warm(
        self, files: Sequence[object], mmap: str, *, views: bool, budget: MemoryBudget
    ) -> PartWarmUp:
        """The load's read-ahead: the session's for the files it holds, the load's own (a
        :class:`~fastload.core.memory.sharing.WarmUp`) for the others."""
        for ahead in self.held.values():  # decides for the files the helper has not reached
            ahead.views = views
        if not views:  # copies read the page cache the session filled; nothing to map
            self.held = {}
        rest = [i for i in range(len(files)) if i not in self.held]
        own = WarmUp([files[i] for i in rest], mmap, views=views, budget=budget)
        return PartWarmUp(self, own, rest)

    def _advance(self, index: int, nbytes: int) -> None:
        key = self.keys[index]
        if key is not None and key in self.session.sizes:
            self.session._advance(key, nbytes)

    @contextmanager
    def progress(self, total: int) -> Iterator[_core.Progress]:
        """The counter of the load's copies of ``total`` bytes: it moves the session's bar over
        the load's files not read ahead, in proportion (the session's bar is drawn or not for
        all its loads)."""
        session = self.session
        with session._lock:
            left = {
                k: session.sizes[k] - session._shown[k]
                for k in set(self.keys)
                if k is not None and k in session.sizes and k not in session._ahead
            }
        shown = [0]

        def advance(done: int) -> None:
            fraction = min(1.0, done / total) if total else 1.0
            target = int(sum(left.values()) * fraction)
            step, shown[0] = target - shown[0], target
            for key, n in left.items():  # spread over the files, in order
                if step <= 0:
                    break
                take = min(step, n)
                session._advance(key, take)
                left[key] -= take
                step -= take

        counter = _core.Progress(advance)
        yield counter
        advance(counter.done)

    def done(self) -> None:
        """The load is over: its files count as done on the bar; the session lets go of their
        mappings (their views keep them)."""
        session = self.session
        for key in set(self.keys):
            if key is not None and key in session.sizes:
                session._advance(key, session.sizes[key])
                session._ahead.pop(key, None)


class PartWarmUp:
    """The read-ahead of one load in a session, as the load uses a
    :class:`~fastload.core.memory.sharing.WarmUp`: ``mappings`` by file index, ``join``,
    ``mapped``."""

    def __init__(self, part: SessionPart, own: WarmUp, rest: list[int]) -> None:
        self.part, self.own = part, own
        self.mappings = {i: a.mapping for i, a in part.held.items()}
        self.mappings.update({rest[j]: m for j, m in own.mappings.items()})

    @property
    def mapped(self) -> int:
        return self.own.mapped + sum(a.mapped for a in self.part.held.values())

    def join(self) -> None:
        try:
            self.own.join()
        finally:
            for i, ahead in self.part.held.items():
                ahead.wait(lambda n, i=i: self.part._advance(i, n))
        self.part.done()
