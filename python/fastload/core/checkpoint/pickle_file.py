"""Pickle checkpoints (``.bin``/``.pt``), read only with ``torch.load(weights_only=True)``.

``from_pretrained(..., allow_pickle=True)`` opens each pickle file as a :class:`PickleFile`, which
offers the interface of :class:`fastload._core.SafetensorsFile` that the loader uses (``path``,
``keys``, ``tensors``, ``info``, ``metadata``, ``_copy_into``), so its tensors go through
exactly the same pipeline as a safetensors file's: key mapping, policies, placement, dtype
conversion, tying.

``weights_only=True`` unpickles tensors and plain containers only: a pickle naming any other
global (the ``__reduce__`` trick that runs code) is refused before anything of it runs. The file is
memory-mapped (``mmap=True``) so it is not read into memory twice; only the legacy (pre-zip)
format, which cannot be mapped, is read whole.
"""

from __future__ import annotations

import ctypes
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from fastload.core.basics.dtypes import CONVERTIBLE, parse_dtype, st_shape, to_st
from fastload.core.basics.errors import (
    CheckpointError,
    RequestError,
    TensorNotFoundError,
    UnsupportedError,
    from_os_error,
)

#: file name endings of pickle checkpoints
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

#: how a pickle file is read, as the load report names it
READ_MODE = "torch.load(weights_only)"

# (name, data pointer, byte length, safetensors dtype, selection), as SafetensorsFile._copy_into
_Job = tuple[str, int, int, str, "list[int] | None"]


def is_pickle(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a pickle checkpoint file (by its ending)."""
    return Path(path).suffix in PICKLE_SUFFIXES


def _reason(error: Exception) -> str:
    """The informative line of a torch.load error (not its advice to retry unsafely)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    boilerplate = ("Weights only load failed", "Check the documentation", "Please file an issue")
    useful = [line for line in lines if not line.startswith(boilerplate)]
    return (useful or lines or [type(error).__name__])[0]


def _torch_load(path: str, mmap: bool) -> object:
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


#: keys under which training checkpoints commonly nest the weights
WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")


def load_state_dict(
    path: str | os.PathLike[str], *, unwrap: bool = False
) -> dict[str, torch.Tensor]:
    """The tensors of a pickled state dict, loaded with ``torch.load(weights_only=True)``.

    With ``unwrap``, a training checkpoint that nests the weights (``{"state_dict": {...},
    "epoch": 3}``, see :data:`WRAPPER_KEYS`) yields the nested dict (``fastload convert`` does
    this; ``from_pretrained`` does not guess). Raises ``CheckpointError`` naming the file when
    ``weights_only`` refuses the pickle (it names a global other than tensors and plain
    containers: code would run), when the file is not a torch pickle, or when it is not a flat
    ``{name: tensor}`` dict (the entry is named).
    """
    where = os.fspath(path)
    try:
        try:
            state = _torch_load(where, mmap=True)
        except RuntimeError as e:
            # Only the legacy (non-zip) format cannot be mapped; torch says so by name.
            if "_use_new_zipfile_serialization" not in str(e):
                raise
            state = _torch_load(where, mmap=False)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{where}: refused by torch.load(weights_only=True), which loads tensors and plain "
            f"containers only: {_reason(e)}"
        ) from None
    except OSError as e:
        raise from_os_error(e, where) from None
    except Exception as e:  # a file from a stranger: any failure to parse is a bad checkpoint
        raise CheckpointError(
            f"{where}: not a checkpoint torch.load(weights_only=True) can read "
            f"({type(e).__name__}: {_reason(e)})"
        ) from None
    if unwrap and isinstance(state, dict):
        for key in WRAPPER_KEYS:
            inner = state.get(key)
            if isinstance(inner, dict) and all(isinstance(v, torch.Tensor) for v in inner.values()):
                state = inner
                break
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: holds a {type(state).__name__}, not a dict of tensors")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{where}: key {name!r} is not a string")
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{where}: entry {name!r} is a {type(value).__name__}, not a tensor; fastload "
                "loads state dicts of tensors only"
            )
        if value.layout != torch.strided or value.device.type != "cpu":
            raise CheckpointError(
                f"{where}: tensor {name!r} is a {value.layout} tensor on {value.device}; only "
                "dense CPU tensors are loaded"
            )
        tensors[name] = value.detach()
    return tensors


def _rows_fit(sel: list[int], numel: int) -> bool:
    """Whether ``[first row, rows, row length, start, stop]`` lies in a tensor of ``numel``
    elements (as the engine checks it)."""
    first, rows, row, start, stop = sel
    inside = rows == 0 or (first + rows - 1) * row + stop <= numel
    return row > 0 and first >= 0 and rows >= 0 and 0 <= start <= stop <= row and inside


class PickleFile:
    """A pickle checkpoint file, behaving like an open :class:`fastload._core.SafetensorsFile`.

    ``tensors()`` reports synthetic ``begin``/``end`` offsets (cumulative byte counts) so that
    ``end - begin`` is each tensor's size; nothing reads them as file positions.
    """

    mode = READ_MODE

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._index(load_state_dict(self._path))

    def _index(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._info: dict[str, tuple[str, list[int], int, int]] = {}
        offset = 0
        for name, t in self._tensors.items():
            try:
                st_dtype = to_st(t.dtype)
            except UnsupportedError:
                raise UnsupportedError(
                    f"{self._path}: tensor {name!r} has dtype {t.dtype}, which fastload does not "
                    "load"
                ) from None
            nbytes = t.numel() * t.element_size()
            # the header's shape, as a safetensors file's: a packed dtype's counts values
            shape = st_shape(t.dtype, t.shape, where=f"{self._path}: tensor {name!r}")
            self._info[name] = (st_dtype, shape, offset, offset + nbytes)
            offset += nbytes

    @property
    def path(self) -> str:
        return self._path

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._info)

    def metadata(self) -> dict[str, str] | None:
        """Always ``None``: a pickled state dict carries no safetensors metadata."""
        return None

    def tensors(self) -> list[tuple[str, str, list[int], int, int]]:
        """``(name, dtype, shape, begin, end)`` of every tensor, in the pickle's order."""
        return [(name, *info) for name, info in self._info.items()]

    def info(self, name: str) -> tuple[str, list[int], int, int]:
        """``(dtype, shape, begin, end)`` of tensor ``name``."""
        if name not in self._info:
            raise TensorNotFoundError(
                f"{self._path}: [unknown-tensor] no tensor named {name!r} in the file"
            )
        return self._info[name]

    def _copy_into(
        self, jobs: list[_Job], threads: int | None = None, progress: Any | None = None
    ) -> int:
        """Fills caller-owned destinations, like ``SafetensorsFile._copy_into`` (reached through
        :func:`fastload.core.basics.engine.copy_into`, which takes tensors): every job is
        checked (name, dtype pair, selection, destination size) before any byte is written, with
        the same error classes; returns bytes written. ``threads`` is unused (torch copies);
        ``progress`` (a ``_core.Progress``) counts the bytes once they are written."""
        del threads
        checked: list[tuple[torch.Tensor, int, int, torch.dtype]] = []
        for name, ptr, nbytes, st_dtype, selection in jobs:
            stored = self.info(name)[0]
            if stored != st_dtype and not (stored in CONVERTIBLE and st_dtype in CONVERTIBLE):
                raise UnsupportedError(
                    f"{self._path}: [unsupported-conversion] tensor {name!r}: cannot convert "
                    f"{stored} to {st_dtype} (conversion supports F32, F16, BF16, F64)"
                )
            dtype = parse_dtype(st_dtype)
            part = self._select(name, selection)
            expected = part.numel() * dtype.itemsize
            if nbytes != expected:
                raise RequestError(
                    f"{self._path}: [destination-size] tensor {name!r}: destination has "
                    f"{nbytes} bytes, expected {expected}"
                )
            if nbytes and not ptr:
                raise RequestError(
                    f"{self._path}: [null-destination] tensor {name!r}: destination pointer is null"
                )
            checked.append((part, ptr, nbytes, dtype))
        with torch.no_grad():
            for part, ptr, nbytes, dtype in checked:
                if nbytes:
                    # The caller owns [ptr, ptr + nbytes) for the duration of the call.
                    raw = (ctypes.c_char * nbytes).from_address(ptr)
                    dest = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
                    dest.view(part.shape).copy_(part)
        written = sum(nbytes for _, _, nbytes, _ in checked)
        if progress is not None:
            progress.add(written)
        return written

    def _select(self, name: str, selection: list[int] | None) -> torch.Tensor:
        """The part of tensor ``name`` a selection takes (``RequestError`` if out of range)."""
        t = self._tensors[name]
        if selection is None:
            return t
        sel = list(selection)
        if len(sel) == 2 and 0 <= sel[0] <= sel[1] <= t.numel():
            return t.reshape(-1)[sel[0] : sel[1]]
        if len(sel) == 3 and 0 <= sel[0] < t.dim() and 0 <= sel[1] <= sel[2] <= t.shape[sel[0]]:
            return t.narrow(sel[0], sel[1], sel[2] - sel[1])
        if len(sel) == 5 and _rows_fit(sel, t.numel()):
            first, rows, row, start, stop = sel
            flat = t.reshape(-1)
            if rows == 0 or start == stop:
                return flat[:0]
            at = flat.storage_offset() + first * row + start
            return flat.as_strided((rows, stop - start), (row, 1), at).reshape(-1)
        raise RequestError(
            f"{self._path}: [invalid-selection] tensor {name!r}: invalid selection {sel} of a "
            f"tensor of shape {list(t.shape)}"
        )

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def __repr__(self) -> str:
        return f"PickleFile({self._path!r}, tensors={len(self._info)})"


class StateDictFile(PickleFile):
    """An in-memory state dict (``from_pretrained(state_dict=...)``) behaving like a checkpoint
    file, so its tensors take the same pipeline as a file's (key mapping, policies, placement,
    dtype conversion, tying). The tensors are copied into the model, never aliased."""

    mode = "state_dict"

    def __init__(self, state_dict: object, name: str = "state_dict") -> None:
        self._path = name
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict of name -> tensor, got {type(state_dict).__name__}"
            )
        tensors: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"state_dict must map str names to tensors; entry {key!r} is a "
                    f"{type(value).__name__}"
                )
            if value.layout != torch.strided:
                raise CheckpointError(f"{name}: tensor {key!r} is a {value.layout} tensor")
            if value.device.type == "meta":  # torch's own error names no tensor
                raise CheckpointError(
                    f"{name}: tensor {key!r} is on the meta device: it holds no data to read "
                    "(a tensor of a model built on meta, never loaded); pass real tensors"
                )
            tensors[key] = value.detach().cpu()
        self._index(tensors)

    def __repr__(self) -> str:
        return f"StateDictFile(tensors={len(self._info)})"
