"""Sample tensors shared by the reader and writer tests: every dtype, compared byte for byte."""

from __future__ import annotations

import json
import os
import struct

import torch

from fastload.core.basics.dtypes import ST_TO_TORCH


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype`` (integers within int32, floats normal, bools 0/1)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(
            shape, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32
        )
        if dtype.is_complex:
            return torch.complex(
                base.float(), base.float().flip(-1) if base.dim() else base.float()
            )
        return base.to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype)


def every_dtype_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A 3x5, a 0-d and an empty tensor of every dtype torch and safetensors share."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype in ST_TO_TORCH.items():
        try:
            tensors[f"t_{name}"] = random_tensor(dtype, (3, 5), gen)
            tensors[f"scalar_{name}"] = random_tensor(dtype, (), gen)
        except (RuntimeError, TypeError):  # a dtype torch cannot fill randomly on this build
            tensors.pop(f"t_{name}", None)
            continue
        tensors[f"empty_{name}"] = torch.empty((0, 4), dtype=dtype)
    return tensors


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: compares NaNs and dtypes torch.equal has no kernel for."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, same_order: bool = True
) -> None:
    """Same names (in the same order unless ``same_order=False``), dtypes, shapes and bytes."""
    if same_order:
        assert list(got) == list(want)
    else:
        assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(raw_bytes(g), raw_bytes(w)), name


def flip_stored_byte(path: str | os.PathLike[str], name: str) -> None:
    """Corrupts a safetensors file in place the way a bad disk or a rewrite would: the first
    byte of tensor ``name``'s data is inverted, the header left as it was."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        begin = json.loads(f.read(length))[name]["data_offsets"][0]
        f.seek(8 + length + begin)
        byte = f.read(1)
        f.seek(8 + length + begin)
        f.write(bytes([byte[0] ^ 0xFF]))
