"""``safe_open(...).get_slice(name)``: a lazy tensor that reads only what an index selects.

``slice_[0:2, :, 5]`` is parsed against the stored shape, then read through the Rust copy engine's
strided selection along the most selective dimension (a run of bytes per outer index), so a
column or row block of a large matrix costs its own bytes, not the whole tensor's. Restrictions
along the other dimensions (and steps) are applied to that block in torch.

Indexing follows safetensors: ints (negative from the end), slices, ``...`` and the empty list;
an index or bound past a dimension is an error rather than clamped. Unlike safetensors, slice
steps are honoured (safetensors ignores them) and negative slice bounds count from the end.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fastload.dtypes import PACKED, to_torch
from fastload.errors import RequestError, UnsupportedError

if TYPE_CHECKING:
    from fastload.reader import SafeOpen


@dataclass(frozen=True)
class _Dim:
    """What an index keeps of one dimension: ``range(start, stop, step)``; ``drop`` for an int."""

    start: int
    stop: int
    step: int
    drop: bool

    @property
    def length(self) -> int:
        return max(0, -(-(self.stop - self.start) // self.step))


def _describe(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)

    def one(i: Any) -> str:
        if isinstance(i, slice):
            parts = ["" if v is None else str(v) for v in (i.start, i.stop)]
            text = ":".join(parts)
            return text + (f":{i.step}" if i.step is not None else "")
        return "..." if i is Ellipsis else repr(i)

    return "[" + ", ".join(one(i) for i in items) + "]"


def parse_index(index: Any, shape: list[int], where: str) -> list[_Dim]:
    """One :class:`_Dim` per dimension of ``shape`` for a ``__getitem__`` index."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        raise RequestError(f"{where}: an index can have only one '...'")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items[at : at + 1] = [slice(None)] * max(fill, 0)
    if len(items) > len(shape):
        raise RequestError(
            f"{where}: {len(items)} indices {_describe(index)} for a {len(shape)}-d tensor"
        )
    items += [slice(None)] * (len(shape) - len(items))
    dims = []
    for d, (item, size) in enumerate(zip(items, shape, strict=True)):
        dims.append(_parse_one(item, d, size, index, shape, where))
    return dims


def _parse_one(item: Any, d: int, size: int, index: Any, shape: list[int], where: str) -> _Dim:
    def out_of_bounds(i: int) -> RequestError:
        return RequestError(
            f"{where}: error during slicing {_describe(index)} with shape {shape}: index {i} out "
            f"of bounds for tensor dimension #{d} of size {size}"
        )

    if isinstance(item, slice):
        step = 1 if item.step is None else operator.index(item.step)
        if step <= 0:
            raise UnsupportedError(f"{where}: slice step must be positive, got {step}")
        start = 0 if item.start is None else operator.index(item.start)
        stop = size if item.stop is None else operator.index(item.stop)
        start = start + size if start < 0 else start
        stop = stop + size if stop < 0 else stop
        for bound in (start, stop):
            if not 0 <= bound <= size:
                raise out_of_bounds(bound - 1 if bound > size else bound)
        return _Dim(start, max(start, stop), step, drop=False)
    if isinstance(item, list) and not item:
        return _Dim(0, 0, 1, drop=False)
    if isinstance(item, list | torch.Tensor) or item is None or isinstance(item, bool):
        raise UnsupportedError(
            f"{where}: index {item!r} is not supported (ints, slices, '...' and [] are)"
        )
    try:
        i = operator.index(item)
    except TypeError:
        raise UnsupportedError(
            f"{where}: index {item!r} is not supported (ints, slices, '...' and [] are)"
        ) from None
    j = i + size if i < 0 else i
    if not 0 <= j < size:
        raise out_of_bounds(i)
    return _Dim(j, j + 1, 1, drop=True)


class SafeSlice:
    """A tensor of an open file, read only when indexed (``safetensors``' ``PySafeSlice``)."""

    def __init__(self, opened: SafeOpen, name: str) -> None:
        self._opened = opened
        self.name = name
        st_dtype, shape, _, _ = opened.file.info(name)  # TensorNotFoundError for a wrong name
        self._st_dtype: str = st_dtype
        self._shape: list[int] = list(shape)

    def get_shape(self) -> list[int]:
        """The stored shape (as the header has it)."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The stored safetensors dtype name (``"F32"``, ``"BF16"`` ...)."""
        return self._st_dtype

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        opened = self._opened
        where = f"{opened.path}: tensor {self.name!r}"
        if self._st_dtype in PACKED:
            # Sub-byte values cannot be cut by the engine; index torch's packed view instead.
            return opened.get_tensor(self.name)[index]
        dims = parse_index(index, self._shape, where)
        dtype = to_torch(self._st_dtype, where=where)
        final = [d.length for d in dims if not d.drop]
        if any(d.length == 0 for d in dims):
            return torch.empty(final, dtype=dtype, device=opened.device)
        stored = self._shape
        restricted = [i for i, d in enumerate(dims) if (d.start, d.stop) != (0, stored[i])]
        if not restricted:
            block = torch.empty(self._shape, dtype=dtype, device=opened.device)
            opened.fill([(self.name, block, None)])
            read_dim = None
        else:
            # Read the block along the dimension that keeps the smallest fraction.
            read_dim = min(
                restricted, key=lambda i: (dims[i].stop - dims[i].start) / self._shape[i]
            )
            d = dims[read_dim]
            shape = list(self._shape)
            shape[read_dim] = d.stop - d.start
            block = torch.empty(shape, dtype=dtype, device=opened.device)
            opened.fill([(self.name, block, [read_dim, d.start, d.stop])])
        view = block[
            tuple(
                slice(0, d.stop - d.start, d.step)
                if i == read_dim
                else slice(d.start, d.stop, d.step)
                for i, d in enumerate(dims)
            )
        ]
        view = view.reshape(final) if len(final) != view.dim() else view
        # A copy when the view is a part of the block, so the block's memory is not kept alive.
        if view.numel() == block.numel():
            return view
        return view.clone(memory_format=torch.contiguous_format)

    def __repr__(self) -> str:
        return f"SafeSlice({self.name!r}, dtype={self._st_dtype}, shape={self._shape})"


__all__ = ["SafeSlice", "parse_index"]
