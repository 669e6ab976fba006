"""The one exception hierarchy of fastload.

Every error fastload raises on purpose is a :class:`FastloadError`. Subclasses also derive from the
built-in exception a caller would naturally catch (``ValueError`` for bad input files), so existing
``except ValueError`` code keeps working.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any, TypeVar

from fastload.core.basics.redaction import redact


class FastloadError(Exception):
    """Base class of every error fastload raises on purpose.

    Its message never carries a URL's query or user-info (a presigned signature, a password):
    they are hidden as it is made (:mod:`fastload.core.basics.redaction`), whoever made it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class CheckpointError(FastloadError, ValueError):
    """A checkpoint file, index or its contents are invalid or do not fit the model.

    The message names the file, the tensor (where there is one) and the rule that was broken.
    The Rust core raises this class directly for header and copy errors.
    """


class UnsupportedError(FastloadError, TypeError):
    """The model or request asks for something fastload cannot do (for example gradient
    checkpointing on a model with no checkpointable block, or a dtype torch lacks)."""


class TensorNotFoundError(FastloadError, KeyError):
    """A tensor name that the checkpoint does not contain."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class RequestError(FastloadError, ValueError):
    """The caller's request is inconsistent: a destination of the wrong size, a slice outside the
    tensor, an unknown option value."""


class FastloadIOError(FastloadError, OSError):
    """The operating system refused a read or write (missing file, permissions, disk full).

    ``errno``, ``strerror`` and ``filename`` are set where the operating system gave an error
    number; the subclasses below are also the matching built-in (``FileNotFoundError`` ...).
    """

    def __str__(self) -> str:  # OSError would re-format it from errno and filename
        return str(self.args[0]) if self.args else super().__str__()


class LoadCancelledError(FastloadError):
    """A copy was cancelled (through its :class:`fastload._core.Progress` or a callback's error)
    before it finished; the destinations hold partial data."""


class MemoryBudgetError(FastloadError, MemoryError):
    """A load that must own its memory (``mmap="copy"``, a dtype conversion, pinned staging)
    needs more than the memory available to the process (its cgroup's limit, else
    ``MemAvailable``: :mod:`fastload.core.memory.budget`); raised before anything is allocated,
    instead of the OOM killer's SIGKILL. The message names the bytes needed and available, where the
    figure came from, and what would work instead. A ``MemoryError`` too."""

    def __init__(self, message: str, needed: int = 0, budget: object = None) -> None:
        super().__init__(message)
        #: bytes the load would have allocated
        self.needed = needed
        #: the :class:`fastload.core.memory.budget.MemoryBudget` it was refused against
        self.budget = budget

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UninitializedTensorError(CheckpointError):
    """A tensor the checkpoint lacks that nothing initializes: no init function of its model,
    no ``reset_parameters()``, and no constructor value fastload could keep (too large, or
    computed from a parameter on ``meta``, as a weight norm's ``original0``). Rather than leave
    such a tensor as ``torch.empty`` left it, fastload refuses to load."""


class PickleRefusedError(CheckpointError):
    """A pickle-based checkpoint (``.bin``/``.pt``) was given without ``allow_pickle=True``."""


class TensorRefusedError(RequestError, RuntimeError):
    """``save_file`` refuses a tensor it cannot store faithfully: tensors sharing memory (a tie
    would be lost) or a tensor on the meta device (no data). A ``RuntimeError`` too, as
    safetensors raises for these."""


class ModelMismatchError(CheckpointError, RuntimeError):
    """``load_model`` found a tensor whose shape differs from the model's, or (``strict=True``)
    missing or unexpected names; ``from_pretrained`` found checkpoint tensors of another shape
    (without ``ignore_mismatched_sizes=True``). A ``RuntimeError`` too, as ``load_state_dict``
    and safetensors raise."""

    #: (model name, checkpoint shape, model shape) of each tensor of another shape, where known
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []


class ReloadError(FastloadError, RuntimeError):
    """A reload (:func:`fastload.reload`) failed after it had begun writing into the model: the
    tensors named (``tensors``) hold new or partly new bytes, the others their old ones, and the
    model and its submodules refuse to run (this error again) until a reload succeeds. A failure
    before the first write, or in a reload with ``atomic=True`` before its commit, leaves every
    tensor as it was and raises the failure itself instead. A ``RuntimeError`` too."""

    def __init__(self, message: str, tensors: list[str] | None = None) -> None:
        super().__init__(message)
        #: the model tensors that may hold new bytes
        self.tensors: list[str] = list(tensors or [])


class FastloadFileNotFoundError(FastloadIOError, FileNotFoundError):
    """A path that does not exist (``errno.ENOENT``)."""


class FastloadPermissionError(FastloadIOError, PermissionError):
    """The operating system denied access (``errno.EACCES``/``EPERM``, a read-only filesystem)."""


class FastloadIsADirectoryError(FastloadIOError, IsADirectoryError):
    """A directory where a file was needed (``errno.EISDIR``)."""


class FastloadNotADirectoryError(FastloadIOError, NotADirectoryError):
    """A path component that is not a directory (``errno.ENOTDIR``)."""


_OS_ERRORS: dict[int, type[FastloadIOError]] = {
    _errno.ENOENT: FastloadFileNotFoundError,
    _errno.EACCES: FastloadPermissionError,
    _errno.EPERM: FastloadPermissionError,
    _errno.EROFS: FastloadPermissionError,
    _errno.EISDIR: FastloadIsADirectoryError,
    _errno.ENOTDIR: FastloadNotADirectoryError,
}


def os_error(
    path: str | os.PathLike[str], errno: int | None, detail: str = "", *, doing: str = ""
) -> FastloadIOError:
    """The :class:`FastloadIOError` for an operating-system error on ``path``: the subclass that
    is also the matching built-in (``FileNotFoundError`` for ``ENOENT`` ...), with ``errno``,
    ``strerror`` and ``filename`` set as ``OSError`` has them.

    The message reads like safetensors' and Python's own: ``"No such file or directory: PATH"``
    (``doing`` adds what fastload was doing, e.g. ``"cannot write the checkpoint"``).
    """
    path = os.fspath(path)
    strerror = os.strerror(errno) if errno else (detail or "I/O error")
    message = f"{strerror}: {path}" + (f" ({doing})" if doing else "")
    err = _OS_ERRORS.get(errno or 0, FastloadIOError)(message)
    err.errno = errno
    err.strerror = strerror
    err.filename = redact(path)
    return err


def store_error(url: str, errno: int | None, message: str) -> FastloadIOError:
    """The :class:`FastloadIOError` for a failed request to object storage (raised by the Rust
    core): ``FileNotFoundError`` for a missing object or bucket (``errno.ENOENT``),
    ``PermissionError`` for denied access (``errno.EACCES``), plain ``FastloadIOError`` for a
    store that could not be reached or kept failing. ``message`` names the URL, the rule
    (``[store-not-found]`` ...), the tensor being read, if any, and the store's answer; it is
    kept whole, and ``filename`` is the URL."""
    err = _OS_ERRORS.get(errno or 0, FastloadIOError)(message)
    err.errno = errno
    err.strerror = os.strerror(errno) if errno else None
    err.filename = redact(url)
    return err


def from_os_error(exc: OSError, path: str | os.PathLike[str], doing: str = "") -> FastloadIOError:
    """``exc`` (a plain ``OSError``) as the matching :class:`FastloadIOError`, naming ``path``."""
    if isinstance(exc, FastloadIOError):
        return exc
    err = os_error(path, exc.errno, str(exc), doing=doing)
    err.__cause__ = exc
    return err


#: safetensors' exception name: ``except SafetensorError`` written for safetensors catches every
#: error fastload raises on purpose once the import names ``fastload.SafetensorError``.
SafetensorError = FastloadError


__all__ = [
    "FastloadError",
    "CheckpointError",
    "UnsupportedError",
    "TensorNotFoundError",
    "RequestError",
    "FastloadIOError",
    "PickleRefusedError",
    "TensorRefusedError",
    "ModelMismatchError",
    "FastloadFileNotFoundError",
    "FastloadPermissionError",
    "FastloadIsADirectoryError",
    "FastloadNotADirectoryError",
    "SafetensorError",
    "os_error",
    "store_error",
    "from_os_error",
    "LoadCancelledError",
    "MemoryBudgetError",
]


_E = TypeVar("_E", bound=FastloadError)


def also_as(error_class: type[_E], original: BaseException) -> type[_E]:
    """``error_class``, made also a subclass of ``original``'s class where Python allows it.

    For an error fastload raises in place of another library's (a model that cannot be built
    from its config raises whatever the model's code raises: ``KeyError``, ``AttributeError``
    ...): code written to catch that library's error keeps catching fastload's, which still is
    a :class:`FastloadError` with fastload's message. ``error_class`` itself where the two
    cannot be combined (an exception class with its own memory layout, a final class).
    """
    base = type(original)
    if issubclass(error_class, base) or not issubclass(base, Exception):
        return error_class
    try:
        return _combined(error_class, base)
    except TypeError:
        return error_class


_COMBINED: dict[tuple[type, type], type] = {}


def _combined(error_class: type[_E], base: type[Exception]) -> type[_E]:
    key = (error_class, base)
    if key not in _COMBINED:

        def __str__(self: BaseException) -> str:  # KeyError would repr() the message
            return str(self.args[0]) if self.args else ""

        namespace: dict[str, Any] = {"__module__": error_class.__module__, "__str__": __str__}
        namespace["__doc__"] = error_class.__doc__
        _COMBINED[key] = type(error_class.__name__, (error_class, base), namespace)
    return _COMBINED[key]
