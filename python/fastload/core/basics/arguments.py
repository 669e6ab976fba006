"""Checks of the arguments of fastload's public entry points, in one place.

Every check raises ``TypeError`` for a value of the wrong type and :class:`RequestError` (a
``ValueError``) for a value of the right type that cannot be used; both messages name the
argument (and the entry point, through ``where``), so a caller knows which of twenty options was
wrong. The checks run before anything is read or written.

The other argument owners: devices (:func:`fastload.core.devices.checks.parse_device`), byte sizes
(:func:`fastload.core.basics.units.parse_bytes`, with its bound
:data:`fastload.core.basics.units.MAX_BYTES`) and thread counts
(:func:`fastload.core.basics.threads.check_threads`).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from fastload.core.basics.errors import RequestError


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def check_bool(value: object, name: str, *, where: str = "", optional: bool = False) -> bool | None:
    """``value`` if it is ``True`` or ``False`` (or ``None`` when ``optional``), else
    ``TypeError`` naming ``name``.

    Truthiness is not enough: ``allow_pickle="no"`` is a true string, and would have enabled what
    it meant to refuse."""
    if isinstance(value, bool) or (optional and value is None):
        return value
    allowed = "True, False or None" if optional else "True or False"
    raise TypeError(f"{_prefix(where)}{name} must be {allowed}, got {_shown(value)}")


def check_module(value: object, name: str = "model", *, where: str = "") -> nn.Module:
    """``value`` if it is an ``nn.Module``, else ``TypeError`` naming ``name``."""
    if isinstance(value, nn.Module):
        return value
    raise TypeError(f"{_prefix(where)}{name} must be an nn.Module, got {_shown(value)}")


def check_names(value: object, name: str, *, where: str = "") -> list[str] | None:
    """``None``, or ``value`` (a list, tuple or set of str) as a list; else ``TypeError`` naming
    ``name``. A single str is refused too: iterated, it would be a list of its characters."""
    if value is None:
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        bad = [v for v in value if not isinstance(v, str)]
        if not bad:
            return list(value)
        raise TypeError(
            f"{_prefix(where)}{name} must be a list of class names (str); it holds {_shown(bad[0])}"
        )
    raise TypeError(
        f"{_prefix(where)}{name} must be a list, tuple or set of class names (str), "
        f"got {_shown(value)}"
    )


def check_folder(value: object, name: str, *, where: str = "") -> str | None:
    """``None``, or ``value`` (a ``str`` or ``os.PathLike`` naming a directory, which may not
    exist yet) as a ``str``.

    Raises:
        TypeError: another type (bytes paths included).
        RequestError: an empty path, or one that exists and is not a directory.
    """
    if value is None:
        return None
    path: Any = os.fspath(value) if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(path, str):
        raise TypeError(f"{_prefix(where)}{name} must be a str or os.PathLike, got {_shown(value)}")
    if not path:
        raise RequestError(f"{_prefix(where)}{name} is an empty path; name a directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise RequestError(f"{_prefix(where)}{name} {path!r} exists and is not a directory")
    return path


__all__ = ["check_bool", "check_folder", "check_module", "check_names"]
