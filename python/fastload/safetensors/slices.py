"""``safe_open(...).get_slice(name)``: a lazy tensor that reads only what an index selects.

Semantics are those of safetensors 0.8 (``framework="pt"``), which indexes a torch view of the
whole stored tensor: ``slice_[index]`` is ``whole[index]`` with torch's rules, for every index
torch accepts (ints, slices with positive steps, bounds past the end clamped, ``...``, ``None``,
bools, lists, integer and boolean tensors and numpy arrays, tuples mixing them), and torch's
error (class and message) for every index torch refuses.

How: the index is first applied to a zero-stride ``uint8`` probe of the stored shape, which costs
no memory for basic indexing; torch itself checks the index there and gives the result shape,
before a byte is read. Then the dimension where the index keeps the smallest covering range is
read through the Rust copy engine's strided selection (a run of bytes per outer index): an int, a
slice, a 1-d boolean mask or an integer index list/tensor along it is covered by the range from
its first to its last selected position, so ``[:, 7]`` of a large matrix costs one column and
``[token_ids]`` the rows from the smallest to the largest id. The index, shifted along that
dimension, is then applied to the block in torch; every other part of it is passed unchanged.

Errors are torch's, re-raised as fastload errors that are also the built-in torch raised
(:class:`SliceIndexError` is an ``IndexError``, a ``ValueError`` becomes a
:class:`~fastload.core.basics.errors.RequestError` ...), so ``except IndexError`` written for
safetensors and ``except fastload.SafetensorError`` both catch them.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from fastload import _core
from fastload.core.basics.dtypes import PACKED, to_torch
from fastload.core.basics.errors import RequestError


class SliceIndexError(RequestError, IndexError):
    """An index torch refuses with ``IndexError`` (out of bounds, too many indices, a mask of the
    wrong shape, an index of a type torch does not take); safetensors raises ``IndexError``."""


class SliceTypeError(RequestError, TypeError):
    """An index torch refuses with ``TypeError`` (a slice bound that is not an integer ...)."""


class SliceRuntimeError(RequestError, RuntimeError):
    """An index torch refuses with ``RuntimeError``."""


#: torch's exception class -> the fastload error raised in its place (exact classes only: a
#: subclass such as ``NotImplementedError`` propagates as it is).
_WRAPPED: dict[type[BaseException], type[RequestError]] = {
    IndexError: SliceIndexError,
    TypeError: SliceTypeError,
    ValueError: RequestError,
    RuntimeError: SliceRuntimeError,
}

# torch treats a non-tuple sequence shorter than this as a tuple of indices when it holds a
# sequence, slice, tensor, ``...`` or ``None`` (numpy's old heuristic, torch's
# ``treatSequenceAsTuple``).
_SEQUENCE_AS_TUPLE_BELOW = 32
# A slice step times a stride at or past this overflows torch's int64 stride arithmetic (an error
# or an odd result, which depend on the strides); such an index is applied to the whole tensor,
# as safetensors applies it.
_STEP_OVERFLOW = 1 << 62


def _numpy() -> Any:
    """numpy if it is imported (an array index can only exist then), else ``None``."""
    return sys.modules.get("numpy")


def _is_ndarray(item: Any) -> bool:
    np = _numpy()
    return np is not None and isinstance(item, np.ndarray)


def _is_int(item: Any) -> bool:
    """A Python or numpy integer scalar (bools are not: torch indexes with them like ``None``)."""
    if isinstance(item, bool):
        return False
    if isinstance(item, int):
        return True
    np = _numpy()
    return np is not None and isinstance(item, np.integer)


def _is_sequence(item: Any) -> bool:
    return isinstance(item, list | tuple | range | str | bytes | bytearray) or _is_ndarray(item)


def _wrap(exc: BaseException, where: str, shape: list[int]) -> RequestError | None:
    cls = _WRAPPED.get(type(exc))
    if cls is None:
        return None
    return cls(f"{where} (shape {shape}): {exc}")


def index_tensor(tensor: torch.Tensor, index: Any, where: str) -> torch.Tensor:
    """``tensor[index]``, with torch's errors raised as fastload errors (see :func:`_wrap`)."""
    try:
        return tensor[index]
    except Exception as exc:
        wrapped = _wrap(exc, where, list(tensor.shape))
        if wrapped is None:
            raise
        raise wrapped from exc


def result_shape(index: Any, shape: list[int], where: str) -> torch.Size:
    """The shape of ``t[index]`` for a tensor ``t`` of ``shape``, as torch computes it, or
    torch's error for that index. Free for basic indexing (a view of a zero-stride probe); an
    advanced index costs one byte per result element."""
    probe = torch.empty((), dtype=torch.uint8).expand(shape)
    return index_tensor(probe, index, where).shape


def _items(index: Any) -> list[Any]:
    """The index as the sequence of items torch applies (``treatSequenceAsTuple``)."""
    if isinstance(index, tuple):
        return list(index)
    if isinstance(index, torch.Tensor) or _is_ndarray(index) or not isinstance(index, list):
        return [index]
    if len(index) < _SEQUENCE_AS_TUPLE_BELOW and any(
        isinstance(x, torch.Tensor | slice) or _is_sequence(x) or x is None or x is Ellipsis
        for x in index
    ):
        return list(index)
    return [index]


def _huge_step(index: Any, reach: int) -> bool:
    """Whether a slice of ``index`` has a step that can overflow its product with a stride
    (``reach`` bounds the strides: the product of the sizes, a size 0 counted as 1, as torch's
    contiguous strides count it)."""
    for item in _items(index):
        if isinstance(item, slice) and item.step is not None:
            try:
                step = operator.index(item.step)
            except TypeError:
                continue  # torch's TypeError comes from the probe
            if abs(step) * reach >= _STEP_OVERFLOW:
                return True
    return False


def _as_index_tensor(item: Any) -> torch.Tensor | None:
    """A list/tuple/range/array/tensor item as a tensor of the values torch indexes with;
    ``None`` for anything else (or a conversion not reproduced here, such as floats)."""
    if isinstance(item, torch.Tensor):
        return item
    if not (isinstance(item, list | tuple | range) or _is_ndarray(item)):
        return None
    try:
        t = torch.tensor(item)
    except (TypeError, ValueError, RuntimeError):
        return None
    if t.dtype == torch.bool or (t.dtype == torch.uint8 and _is_ndarray(item)):
        return t
    return t if t.dtype in (torch.int64, torch.int32, torch.int16) else None


def _width(item: Any, t: torch.Tensor | None) -> int | None:
    """How many stored dimensions ``item`` indexes (``t``: its :func:`_as_index_tensor`);
    ``None`` when not known here."""
    if item is None or isinstance(item, bool):
        return 0
    if isinstance(item, slice) or _is_int(item):
        return 1
    if t is None:
        return None
    if t.dtype in (torch.bool, torch.uint8):  # a mask: one dimension per mask dimension
        return t.dim()
    return 1


def _cover(item: Any, t: torch.Tensor | None, size: int) -> tuple[int, int, Any] | None:
    """``(lo, hi, shifted)``: the range that ``item`` selects from along a dimension of
    ``size``, and the item that selects the same from ``range(lo, hi)``; ``None`` where that is
    not worked out here (the dimension is then read whole). Only called for an index torch
    accepted and whose result is not empty, so every selected position is in bounds."""
    if _is_int(item):
        i = operator.index(item)
        j = i + size if i < 0 else i
        return (j, j + 1, 0) if 0 <= j < size else None
    if isinstance(item, slice):
        try:
            start, stop, step = (
                None if v is None else operator.index(v) for v in (item.start, item.stop, item.step)
            )
        except TypeError:
            return None
        # Bounds past the ends clamp (torch first truncates them to int64, to the same effect).
        start, stop, step = slice(start, stop, step).indices(size)
        if step <= 0:
            return None
        n = len(range(start, stop, step))
        if n == 0:
            return None
        hi = start + (n - 1) * step + 1
        return start, hi, slice(0, hi - start, step)
    if t is None or t.dim() == 0 or t.numel() == 0:
        return None
    if t.dtype == torch.bool:  # a 1-d mask: from its first to its last True
        if t.dim() != 1 or t.shape[0] != size:
            return None
        selected = t.nonzero()
        if selected.numel() == 0:
            return None
        lo, hi = int(selected[0]), int(selected[-1]) + 1
        return lo, hi, t[lo:hi]
    if t.dtype == torch.uint8:  # torch's deprecated byte mask: left to torch
        return None
    t = t.to(torch.int64)
    if int(t.min()) < -size or int(t.max()) >= size:
        return None
    t = torch.where(t < 0, t + size, t)
    lo, hi = int(t.min()), int(t.max()) + 1
    return lo, hi, t - lo


def read_plan(index: Any, shape: list[int]) -> tuple[int, int, int, tuple[Any, ...]] | None:
    """``(dim, lo, hi, key)``: read ``range(lo, hi)`` along ``dim`` and index that block with
    ``key``; ``None``: the index is not understood here (read everything, index with ``index``).

    ``dim`` is the dimension where the index keeps the smallest covering range; ``(lo, hi)``
    is the whole of it when no dimension is narrowed. Only called for a non-empty result of an
    index torch accepted.
    """
    items = _items(index)
    if sum(item is Ellipsis for item in items) > 1:
        return None  # torch's rules for several '...' are its own
    tensors = [_as_index_tensor(item) for item in items]
    widths = [0 if i is Ellipsis else _width(i, t) for i, t in zip(items, tensors, strict=True)]
    if any(w is None for w in widths):
        return None
    free = len(shape) - sum(w or 0 for w in widths)
    if free < 0:
        return None
    best: tuple[float, int, int, int, int, Any] | None = None
    dim = 0
    for at, (item, t, width) in enumerate(zip(items, tensors, widths, strict=True)):
        if item is Ellipsis:
            dim += free
            continue
        cover = _cover(item, t, shape[dim]) if width == 1 else None
        if cover is not None:
            lo, hi, shifted = cover
            fraction = (hi - lo) / shape[dim]
            if best is None or fraction < best[0]:
                best = (fraction, at, dim, lo, hi, shifted)
        dim += width or 0
    key = tuple(items)
    if best is None or best[0] == 1:
        return 0, 0, shape[0] if shape else 0, key
    _, at, dim, lo, hi, shifted = best
    return dim, lo, hi, key[:at] + (shifted,) + key[at + 1 :]


def _own(result: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``result`` (an index of ``block``) as a tensor of its own: a copy when it is a view of a
    part of the block, so that the block's memory is not kept alive."""
    if result._is_view() and result.numel() != block.numel():
        return result.clone(memory_format=torch.contiguous_format)
    return result


class OpenFile(Protocol):
    """What a slice reads through: an open file (:class:`fastload.safetensors.files.SafeOpen`,
    which hands itself to each slice it makes, so this module needs nothing of it)."""

    path: str
    device: torch.device

    @property
    def file(self) -> _core.SafetensorsFile: ...

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, on :attr:`device`."""

    def fill(self, items: Iterable[tuple[str, torch.Tensor, list[int] | None]]) -> int:
        """Fills ``(name, destination, selection)`` items from the file."""


class SafeSlice:
    """A tensor of an open file, read only when indexed (``safetensors``' ``PySafeSlice``)."""

    def __init__(self, opened: OpenFile, name: str) -> None:
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
            # Sub-byte values cannot be cut by the engine; index torch's packed view instead
            # (safetensors 0.8 refuses every index of a packed tensor with RuntimeError).
            return index_tensor(opened.get_tensor(self.name), index, where)
        dtype = to_torch(self._st_dtype, where=where)
        whole = self._shape[0] if self._shape else 0
        if _huge_step(index, math.prod(max(n, 1) for n in self._shape)):
            block = self._block(dtype, 0, 0, whole)
            return _own(index_tensor(block, index, where), block)
        want = result_shape(index, self._shape, where)  # torch's checks, before any read
        if want.numel() == 0:
            return torch.empty(want, dtype=dtype, device=opened.device)
        plan = read_plan(index, self._shape)
        if plan is not None:
            dim, lo, hi, key = plan
            block = self._block(dtype, dim, lo, hi)
            try:
                got = block[key]
            except (IndexError, TypeError, ValueError, RuntimeError):
                got = None  # defensively: torch accepted the index on the whole shape
            if got is not None and got.shape == want:
                return _own(got, block)
        # Not understood here (or, defensively, a shape torch would not give): all of it.
        block = self._block(dtype, 0, 0, whole)
        return _own(index_tensor(block, index, where), block)

    def _block(self, dtype: torch.dtype, dim: int, lo: int, hi: int) -> torch.Tensor:
        """``range(lo, hi)`` along ``dim`` read from the file (all of it when that is the whole
        dimension, or the tensor is 0-d)."""
        opened = self._opened
        shape = list(self._shape)
        if not shape or (lo, hi) == (0, shape[dim]):
            block = torch.empty(shape, dtype=dtype, device=opened.device)
            opened.fill([(self.name, block, None)])
        else:
            shape[dim] = hi - lo
            block = torch.empty(shape, dtype=dtype, device=opened.device)
            opened.fill([(self.name, block, [dim, lo, hi])])
        return block

    def __repr__(self) -> str:
        return f"SafeSlice({self.name!r}, dtype={self._st_dtype}, shape={self._shape})"


__all__ = [
    "OpenFile",
    "SafeSlice",
    "SliceIndexError",
    "SliceRuntimeError",
    "SliceTypeError",
    "index_tensor",
    "read_plan",
    "result_shape",
]
