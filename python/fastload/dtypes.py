"""Mapping between safetensors dtype names and torch dtypes."""

from __future__ import annotations

import torch

from fastload.errors import UnsupportedError

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
    }
    # Older torch builds lack some of these; they are simply unsupported there.
    return {st: getattr(torch, tn) for st, tn in names.items() if hasattr(torch, tn)}


ST_TO_TORCH: dict[str, torch.dtype] = _build()
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}


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
