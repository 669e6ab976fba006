"""A smoke test of an installed fastload wheel on any platform, bitwise against safetensors.

Run by ``scripts/aarch64-smoke.sh`` inside an aarch64 Python under qemu (``python
tests/support/platform_smoke.py``, fastload, torch and safetensors installed, this folder on the
path for
``tensor_samples``); it runs natively too. It checks, each result byte for byte:

- ``load_file`` of every dtype torch and safetensors share (and a tensor large enough for several
  copy threads) against ``safetensors.torch.load_file``; ``save_file`` writes safetensors' bytes;
- ``safe_open``: ``get_tensor``, ``get_slice`` with slices on each axis, metadata, and dtype
  conversions during the copy (random bit patterns, multiples of 64 elements) against torch's
  ``Tensor.to``, the arithmetic that differs most between CPUs: every value that is not a NaN
  bitwise; a NaN must stay a NaN, and NaN bits that differ from this torch's are printed (torch
  writes different NaN bits on different CPUs, fastload writes x86 torch's);
- ``from_pretrained`` of a small ``nn.Module`` built here (an embedding, a tied head, a
  layer norm, a convolution, a non-persistent buffer) against the same module loaded with
  ``safetensors.torch.load_model``, in its stored dtype and converted to bfloat16.

Exits non-zero on the first difference, naming the tensor.
"""

from __future__ import annotations

import platform
import sys
import tempfile
from pathlib import Path

import safetensors.torch as st
import torch
from tensor_samples import assert_bitwise_equal, every_dtype_tensors, raw_bytes

import fastload
import safetensors

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _random_bits(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` values of ``dtype`` from random bytes: every exponent, subnormals, NaNs, infinities."""
    width = torch.finfo(dtype).bits // 8
    return torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8).view(dtype)


def check_load_and_save(work: Path) -> None:
    tensors = every_dtype_tensors(seed=1)
    gen = torch.Generator().manual_seed(2)
    tensors["big"] = torch.randn(1024, 1031, generator=gen).to(torch.bfloat16)  # ~2 MiB
    ref_path, ours_path = work / "ref.safetensors", work / "ours.safetensors"
    st.save_file(tensors, str(ref_path), metadata={"format": "pt"})
    assert_bitwise_equal(fastload.load_file(ref_path), st.load_file(str(ref_path)))
    fastload.save_file(tensors, ours_path, metadata={"format": "pt"})
    assert ours_path.read_bytes() == ref_path.read_bytes(), "save_file: not safetensors' bytes"
    print(f"load_file, save_file: {len(tensors)} tensors, every dtype, bitwise ok")


def check_safe_open(work: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = {f"bits_{str(d)[6:]}": _random_bits(d, 64 * 97, gen).reshape(97, 64) for d in FLOATS}
    tensors["w"] = torch.randn(48, 40, 3, generator=gen)
    path = work / "slices.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt", "origin": "smoke"})
    slices = [
        (slice(None), slice(0, 16)),
        (slice(5, 17),),
        (slice(1, 48, 5), slice(3, 40, 7), slice(1, 3)),
        (3, slice(None), 2),
    ]
    with (
        fastload.safe_open(path, framework="pt") as ours,
        safetensors.safe_open(str(path), framework="pt") as ref,
    ):
        assert ours.metadata() == ref.metadata()
        assert list(ours.keys()) == list(ref.keys())
        for name in ref.keys():
            assert torch.equal(raw_bytes(ours.get_tensor(name)), raw_bytes(ref.get_tensor(name)))
        for index in slices:
            got, want = ours.get_slice("w")[index], ref.get_slice("w")[index]
            assert got.shape == want.shape and torch.equal(got, want), f"w{index}"
        nan_notes = []
        for name in (n for n in ref.keys() if n.startswith("bits_")):
            src = ref.get_tensor(name)
            for dst in (d for d in FLOATS if d != src.dtype):
                got, want = ours.get_tensor(name, dtype=dst), src.to(dst)
                assert got.dtype == dst and got.shape == want.shape, name
                note = _compare_conversion(src, got, want)
                if note:
                    nan_notes.append(f"{src.dtype} -> {dst}: {note}")
    pairs = len(FLOATS) * (len(FLOATS) - 1)
    print(f"safe_open: get_tensor, {len(slices)} slices, {pairs} conversions of random bits: ok")
    for note in nan_notes:
        print(f"  NaN bits differ from this torch's (docs: Reliability, Conversions): {note}")


def _compare_conversion(src: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> str:
    """Every value that is not a NaN converts to torch's bits, every NaN to a NaN. Which NaN torch
    writes depends on its CPU kernels (fastload writes x86 torch's): a difference there is
    returned, described, not raised."""
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    g, w = got.reshape(-1).view(bits), want.reshape(-1).view(bits)
    nan, mask = torch.isnan(src.reshape(-1)), (1 << (8 * got.element_size())) - 1
    wrong = ((g != w) & ~nan).nonzero().reshape(-1)
    if len(wrong):
        i = int(wrong[0])
        raise AssertionError(
            f"{src.dtype} -> {got.dtype}: {len(wrong)} values differ from torch's, the first at "
            f"{i}: got {int(g[i]) & mask:#x}, torch {int(w[i]) & mask:#x}"
        )
    assert bool(torch.isnan(got.reshape(-1)[nan]).all()), f"{src.dtype} -> {got.dtype}: a NaN lost"
    differ = ((g != w) & nan).nonzero().reshape(-1)
    if not len(differ):
        return ""
    i = int(differ[0])
    return (
        f"{len(differ)} of {int(nan.sum())} NaNs, e.g. fastload {int(g[i]) & mask:#x}, "
        f"torch {int(w[i]) & mask:#x}"
    )


class Tiny(torch.nn.Module):
    """A small language-model-like module: its head is tied to its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 24)
        self.conv = torch.nn.Conv1d(24, 24, 3, padding=1)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).transpose(1, 2)
        return self.head(self.norm(self.conv(h).transpose(1, 2)))


def check_from_pretrained(work: Path) -> None:
    torch.manual_seed(4)
    path = work / "model.safetensors"
    st.save_model(Tiny(), str(path))
    ids = torch.arange(16).reshape(2, 8) % 50
    for dtype in (None, torch.bfloat16):
        want = Tiny()
        st.load_model(want, str(path))
        want = want.eval() if dtype is None else want.to(dtype).eval()
        got = fastload.from_pretrained(Tiny, path, **({} if dtype is None else {"dtype": dtype}))
        assert_bitwise_equal(got.state_dict(), want.state_dict())
        assert got.head.weight is got.embed.weight, "the tied head was not re-tied"
        assert not any(t.is_meta for t in [*got.parameters(), *got.buffers()])
        with torch.no_grad():
            assert torch.equal(got(ids), want(ids)), f"outputs differ ({dtype})"
    print("from_pretrained: an nn.Module with a tied head, stored and bfloat16: bitwise ok")


def main() -> int:
    print(
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, fastload {fastload.__version__} "
        f"from {Path(fastload.__file__).parent}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for check in (check_load_and_save, check_safe_open, check_from_pretrained):
            check(Path(tmp))
    print("platform smoke test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
