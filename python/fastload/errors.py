"""The one exception hierarchy of fastload.

Every error fastload raises on purpose is a :class:`FastloadError`. Subclasses also derive from the
built-in exception a caller would naturally catch (``ValueError`` for bad input files), so existing
``except ValueError`` code keeps working.
"""

from __future__ import annotations


class FastloadError(Exception):
    """Base class of every error fastload raises on purpose."""


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
    """The operating system refused a read or write (missing file, permissions, disk full)."""


class LoadCancelledError(FastloadError):
    """A copy was cancelled (through its :class:`fastload._core.Progress` or a callback's error)
    before it finished; the destinations hold partial data."""


class PickleRefusedError(CheckpointError):
    """A pickle-based checkpoint (``.bin``/``.pt``) was given without ``allow_pickle=True``."""


__all__ = [
    "FastloadError",
    "CheckpointError",
    "UnsupportedError",
    "TensorNotFoundError",
    "RequestError",
    "FastloadIOError",
    "PickleRefusedError",
    "LoadCancelledError",
]
