"""A collective read's destinations checked as a single process's read checks them, before any
byte: a collective read copies out of exchanged chunks with torch, which would truncate a float
into an integer tensor or fail with a bare shape error where the engine refuses naming the file
and the tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from fastload.core.basics.dtypes import CONVERTIBLE, to_st
from fastload.core.basics.errors import RequestError, TensorNotFoundError, UnsupportedError
from fastload.core.checkpoint.opened import StoredTensor

__all__ = ["check_destination"]


class Opened(Protocol):
    """What the check reads of a checkpoint (an ``OpenCheckpoint``, or a collective read's
    ``Checkpoint``): its tensors, and its files (for their paths)."""

    @property
    def tensors(self) -> Mapping[str, StoredTensor]: ...

    @property
    def files(self) -> Sequence[Any]: ...


def check_destination(ckpt: Opened, name: str, dest: torch.Tensor, selection: Any) -> None:
    """The checks a single process's read makes of a destination before any byte (the engine's:
    the tensor exists, its dtype converts to the destination's, the destination's size is the
    selection's), with the same errors naming the file and the tensor: a collective read copies
    out of exchanged chunks with torch, which would truncate or refuse without them."""
    stored = ckpt.tensors.get(name)
    if stored is None:
        raise TensorNotFoundError(f"collective load: tensor {name!r} is not in the checkpoint")
    path = getattr(ckpt.files[stored.file], "path", "")
    if not isinstance(dest, torch.Tensor):
        raise UnsupportedError(
            f"{path}: tensor {name!r}: the destination is a {type(dest).__name__}, not a tensor"
        )
    wanted = to_st(dest.dtype)
    if wanted != stored.st_dtype and not {wanted, stored.st_dtype} <= CONVERTIBLE:
        raise UnsupportedError(
            f"{path}: [unsupported-conversion] tensor {name!r}: cannot convert "
            f"{stored.st_dtype} to {wanted} (conversion supports F32, F16, BF16, F64)"
        )
    shape = stored.torch_shape
    if hasattr(selection, "take"):  # a richer selection: its result's size, computed on meta
        meta = torch.empty(shape, dtype=stored.dtype, device="meta")
        selected = selection.take(meta).numel()
    elif selection is not None and len(selection) == 2:
        selected = selection[1] - selection[0]
    elif selection is not None:
        dim, start, stop = selection
        selected = math.prod(shape) // shape[dim] * (stop - start) if shape[dim] else 0
    else:
        selected = math.prod(shape)
    if dest.numel() != selected:
        size = dest.element_size()
        raise RequestError(
            f"{path}: [destination-size] tensor {name!r}: destination has "
            f"{dest.numel() * size} bytes, expected {selected * size}"
        )
