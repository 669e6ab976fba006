"""Dtype conversions on load are bitwise equal to torch's ``Tensor.to`` on every value: random
bit patterns, rounding edge cases (halfway points, subnormals, overflow) and NaNs with any sign
and payload. F64 -> BF16 rounds through F32 as torch does.

torch itself converts NaNs differently in its vectorized loop body and its scalar tail (an F16
signalling NaN becomes ``0x7fc02000`` in the body and ``0x7fffffff`` in the tail), so the
reference is always taken from tensors of a multiple of 64 elements, all in the body; fastload
gives the body's result for every element (see the README, "Conversions")."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file as st_save_file

from fastload import _core
from fastload.core.basics.dtypes import to_st
from fastload.core.basics.engine import copy_into

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float64: torch.int64, torch.float32: torch.int32}
PAIRS = [(a, b) for a in FLOATS for b in FLOATS if a != b]


def _int(dtype: torch.dtype) -> torch.dtype:
    return BITS.get(dtype, torch.int16)


def _random_bits(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = np.random.default_rng(seed)
    width = torch.finfo(dtype).bits // 8
    raw = gen.integers(0, 256, size=n * width, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).clone()


def _edges(src: torch.dtype, dst: torch.dtype) -> torch.Tensor:
    """Values of ``src`` at and around the rounding boundaries of ``dst``: the midpoints between
    neighbouring ``dst`` values (exact, one ulp of ``src`` above and below), subnormals, the
    overflow threshold, zeros and infinities, with both signs."""
    finfo = torch.finfo(dst)
    k = torch.arange(0, 1 << 16, 7, dtype=torch.int32)
    if dst == torch.float32:
        k = torch.randint(0, 0x7F800000, (20000,), generator=torch.Generator().manual_seed(5))
    lows = (
        k.to(_int(dst)).view(dst).to(torch.float64)
        if dst != torch.float32
        else k.view(dst).to(torch.float64)
    )
    highs = (
        (k + 1).to(_int(dst)).view(dst).to(torch.float64)
        if dst != torch.float32
        else (k + 1).view(dst).to(torch.float64)
    )
    mids = ((lows + highs) / 2)[torch.isfinite(lows) & torch.isfinite(highs)]
    special = torch.tensor(
        [0.0, finfo.max, finfo.tiny, finfo.smallest_normal / 2, float("inf")], dtype=torch.float64
    )
    over = torch.tensor(
        [float(finfo.max) * (1 + 2.0**-k) for k in range(8, 12)], dtype=torch.float64
    )
    vals = torch.cat([mids, special, over]).to(src)
    up = torch.nextafter(vals, torch.full_like(vals, float("inf")))
    down = torch.nextafter(vals, torch.full_like(vals, -float("inf")))
    out = torch.cat([vals, up, down])
    return torch.cat([out, -out])


def _nans(src: torch.dtype) -> torch.Tensor:
    """Every sign, quiet and signalling, payloads from 1 bit to all bits."""
    bits = torch.finfo(src).bits
    mant = {64: 52, 32: 23, 16: 10 if src == torch.float16 else 7}[bits]
    exp_all = ((1 << (bits - 1 - mant)) - 1) << mant
    ends = {1, 2, 3, (1 << (mant - 1)) - 1, 1 << (mant - 1), (1 << mant) - 1}
    singles = {1 << i for i in range(mant)} | {(1 << mant) - (1 << i) for i in range(mant)}
    payloads = sorted(ends | singles)
    ints = [exp_all | p for p in payloads] + [(1 << (bits - 1)) | exp_all | p for p in payloads]
    signed = [i - (1 << bits) if i >= 1 << (bits - 1) else i for i in ints]
    return torch.tensor(signed, dtype=_int(src)).view(src)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """``t`` repeated to a multiple of 64 elements (torch's vectorized body only)."""
    reps = -(-64 // max(t.numel(), 1))
    t = t.repeat(reps)
    return t[: t.numel() - t.numel() % 64] if t.numel() >= 64 else t


def _fastload_to(t: torch.Tensor, dst: torch.dtype, path: Path) -> torch.Tensor:
    st_save_file({"t": t}, str(path))
    file = _core.SafetensorsFile(str(path))
    out = torch.empty(t.shape, dtype=dst)
    copy_into(file, [("t", out, to_st(dst), None)], 1)
    return out


def _assert_bitwise(t: torch.Tensor, dst: torch.dtype, path: Path) -> None:
    t = _padded(t)
    want = t.to(dst).view(_int(dst))
    got = _fastload_to(t, dst, path).view(_int(dst))
    bad = (want != got).nonzero().flatten()
    if bad.numel():
        src_bits = t.view(_int(t.dtype))
        examples = [
            (hex(int(src_bits[i]) & ((1 << (8 * t.element_size())) - 1)),
             hex(int(want[i]) & ((1 << (8 * want.element_size())) - 1)),
             hex(int(got[i]) & ((1 << (8 * got.element_size())) - 1)))
            for i in bad[:5].tolist()
        ]  # fmt: skip
        pytest.fail(
            f"{bad.numel()} of {t.numel()} differ from torch (src, torch, fastload): {examples}"
        )


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_random_bit_patterns_convert_as_torch_does(src, dst, tmp_path: Path) -> None:
    t = _random_bits(src, 1 << 16, seed=FLOATS.index(src) * 4 + FLOATS.index(dst))
    _assert_bitwise(t, dst, tmp_path / "r.safetensors")


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_rounding_edge_cases_convert_as_torch_does(src, dst, tmp_path: Path) -> None:
    _assert_bitwise(_edges(src, dst), dst, tmp_path / "e.safetensors")


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_nans_of_any_sign_and_payload_convert_as_torch_does(src, dst, tmp_path: Path) -> None:
    nans = _nans(src)
    if platform.machine() in ("x86_64", "AMD64") or dst != torch.bfloat16:
        _assert_bitwise(nans, dst, tmp_path / "n.safetensors")
        return
    # fastload writes x86_64 torch's NaN bits everywhere; torch on aarch64 writes others for a
    # NaN converted to BF16 (docs/reliability.md): there a NaN must stay a NaN, where it was
    t = _padded(nans)
    got = _fastload_to(t, dst, tmp_path / "n.safetensors")
    assert torch.equal(got.isnan(), t.to(dst).isnan())


def test_f64_to_bf16_rounds_through_f32_like_torch(tmp_path: Path) -> None:
    # Just above the midpoint between bf16 1.0 and its successor, by less than an f32 ulp: exact
    # rounding would go up, torch (and fastload) round to f32 first, land on the midpoint, and
    # round to even (1.0).
    x = torch.tensor([1.0 + 2.0**-8 + 2.0**-40] * 64, dtype=torch.float64)
    got = _fastload_to(x, torch.bfloat16, tmp_path / "x.safetensors")
    assert torch.equal(got, torch.ones(64, dtype=torch.bfloat16))
