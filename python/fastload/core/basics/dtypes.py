"""Mapping between safetensors dtype names and torch dtypes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fastload.core.basics.errors import RequestError, UnsupportedError

# Conversions the Rust copy engine does during the copy.
CONVERTIBLE = frozenset({"F32", "F16", "BF16", "F64"})


def _build() -> dict[str, torch.dtype]:
    names = {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "I16": "int16",
        "U16": "uint16",
        "F16": "float16",
        "BF16": "bfloat16",
        "I32": "int32",
        "U32": "uint32",
        "F32": "float32",
        "C64": "complex64",
        "F64": "float64",
        "I64": "int64",
        "U64": "uint64",
        "F8_E5M2": "float8_e5m2",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        # Two 4-bit values per torch element; see torch_shape / st_shape for the shapes.
        "F4": "float4_e2m1fn_x2",
    }
    # Older torch builds lack some of these; they are simply unsupported there.
    return {st: getattr(torch, tn) for st, tn in names.items() if hasattr(torch, tn)}


ST_TO_TORCH: dict[str, torch.dtype] = _build()
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}


#: safetensors dtypes stored packed, several values to one torch element: safetensors' header
#: shape counts values (the last dimension is ``PACKED[dtype]`` times torch's), as its writer does.
PACKED: dict[str, int] = {"F4": 2}


def torch_shape(st_dtype: str, shape: list[int], *, where: str = "") -> list[int]:
    """The torch shape of a tensor stored with header ``shape``: the same, except for packed
    dtypes (F4), whose last dimension holds ``PACKED[dtype]`` values per torch element."""
    per = PACKED.get(st_dtype)
    if per is None:
        return list(shape)
    if not shape or shape[-1] % per:
        prefix = f"{where}: " if where else ""
        raise UnsupportedError(
            f"{prefix}{st_dtype} shape {list(shape)}: torch packs {per} values per element, so the "
            f"last dimension must be a multiple of {per}"
        )
    return [*shape[:-1], shape[-1] // per]


def st_shape(dtype: torch.dtype, shape: torch.Size | list[int], *, where: str = "") -> list[int]:
    """The header shape of a torch tensor: its shape, with the last dimension of packed dtypes
    counted in values (a ``float4_e2m1fn_x2`` tensor of shape ``[2, 2]`` holds ``[2, 4]``)."""
    per = PACKED.get(TORCH_TO_ST.get(dtype, ""))
    if per is None:
        return list(shape)
    if len(shape) == 0:
        prefix = f"{where}: " if where else ""
        raise UnsupportedError(f"{prefix}a 0-d {dtype} tensor has no safetensors shape")
    return [*shape[:-1], shape[-1] * per]


def to_torch(st_dtype: str, *, where: str = "") -> torch.dtype:
    """The torch dtype of a safetensors dtype name; ``UnsupportedError`` if torch has none."""
    try:
        return ST_TO_TORCH[st_dtype]
    except KeyError:
        prefix = f"{where}: " if where else ""
        raise UnsupportedError(
            f"{prefix}safetensors dtype {st_dtype} has no torch equivalent in torch "
            f"{torch.__version__}"
        ) from None


def to_st(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype; ``UnsupportedError`` if the format has none."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise UnsupportedError(f"torch dtype {dtype} cannot be stored in safetensors") from None


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Accepts a torch dtype, ``"bfloat16"``/``"float32"``-style names or safetensors names."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        if value in ST_TO_TORCH:
            return ST_TO_TORCH[value]
        candidate = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise UnsupportedError(f"unknown dtype {value!r}")


def conversion_dtype(value: str | torch.dtype) -> torch.dtype:
    """``value`` as a dtype the copy engine converts to (one of :data:`CONVERTIBLE`), else
    ``RequestError``; ``UnsupportedError`` for a name that is no dtype at all."""
    want = parse_dtype(value)
    if to_st(want) not in CONVERTIBLE:
        raise RequestError(
            f"dtype must be a floating-point type (float32/float16/bfloat16/float64), got {want}"
        )
    return want


def main_floating_dtype(sizes: Iterable[tuple[str, int]]) -> torch.dtype | None:
    """The floating dtype holding the most bytes among ``(safetensors dtype, nbytes)`` pairs
    (``None``: none is floating): what a checkpoint, or one file of it, is stored in."""
    totals: dict[str, int] = {}
    for st_dtype, nbytes in sizes:
        if st_dtype in CONVERTIBLE:
            totals[st_dtype] = totals.get(st_dtype, 0) + nbytes
    return parse_dtype(max(totals, key=totals.__getitem__)) if totals else None
