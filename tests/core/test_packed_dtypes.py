"""Packed sub-byte tensors (safetensors ``F4``, torch ``float4_e2m1fn_x2``: two 4-bit values per
torch element, the storage of NVFP4/MXFP4 weights) through every entry point that reads a
stored tensor into torch: a model load (both read modes, views and copies), a pickle, a reload,
vLLM's weight stream (views, copies, staged, a weight loader's slices). Each is compared with
``safetensors.torch``: the header counts values (``[8, 32]``), torch's tensor holds packed pairs
(``[8, 16]``), the bytes are the file's."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from tensor_samples import raw_bytes
from torch import nn

import fastload
from fastload.integrations.vllm.adopt import ENGINE_MIN, CopyWatch
from fastload.integrations.vllm.options import VllmLoadOptions
from fastload.integrations.vllm.weights import CheckpointWeights

pytestmark = pytest.mark.skipif(
    not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4_e2m1fn_x2"
)

ROWS, PAIRS = 8, 16  # torch's shape; the header's is [ROWS, 2 * PAIRS]


def _packed(seed: int, rows: int = ROWS, pairs: int = PAIRS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, pairs), generator=gen, dtype=torch.int32)
    return raw.to(torch.uint8).view(torch.float4_e2m1fn_x2)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 100)
    # a float scale beside the packed weight, as NVFP4/MXFP4 checkpoints store them
    return {"w": _packed(seed), "scale": torch.randn(ROWS, generator=gen)}


def _file(tmp_path: Path, seed: int = 0, name: str = "model.safetensors") -> Path:
    path = tmp_path / name
    st.save_file(_tensors(seed), str(path))
    return path


class Packed(nn.Module):
    """A module holding a float4 parameter, as a quantized layer does."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(
            torch.empty(ROWS, PAIRS, dtype=torch.float4_e2m1fn_x2), requires_grad=False
        )
        self.scale = nn.Parameter(torch.empty(ROWS))


def _assert_as_safetensors(got: torch.Tensor, path: Path, name: str) -> None:
    want = st.load_file(str(path))[name]
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
    assert torch.equal(raw_bytes(got), raw_bytes(want)), name


def test_the_header_counts_values_and_torch_counts_packed_pairs(tmp_path: Path) -> None:
    path = _file(tmp_path)
    with fastload.safe_open(path) as f:
        assert list(f.shape("w")) == [ROWS, 2 * PAIRS]
    assert tuple(st.load_file(str(path))["w"].shape) == (ROWS, PAIRS)


@pytest.mark.parametrize("mmap", ["auto", "copy"])
@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_a_model_loads_a_float4_tensor_as_safetensors_reads_it(
    tmp_path: Path, read_mode: str, mmap: str
) -> None:
    path = _file(tmp_path)
    model, report = fastload.from_pretrained(
        Packed, path, read_mode=read_mode, mmap=mmap, output_loading_info=True
    )
    _assert_as_safetensors(model.w, path, "w")
    _assert_as_safetensors(model.scale, path, "scale")
    assert report.tensors_loaded == 2 and not report.missing and not report.mismatched
    assert report.bytes_read == ROWS * PAIRS + ROWS * 4  # the file's bytes, not twice the F4's


def test_a_model_loads_a_float4_tensor_from_a_pickle(tmp_path: Path) -> None:
    tensors = _tensors(0)
    torch.save(tensors, tmp_path / "model.pt")
    model = fastload.from_pretrained(Packed, tmp_path / "model.pt", allow_pickle=True)
    assert torch.equal(raw_bytes(model.w), raw_bytes(tensors["w"]))


@pytest.mark.parametrize("mmap", ["auto", "copy"])
def test_a_reload_writes_a_float4_tensor_in_place(tmp_path: Path, mmap: str) -> None:
    first = _file(tmp_path, 0, "first.safetensors")
    second = _file(tmp_path, 1, "second.safetensors")
    model = fastload.from_pretrained(Packed, first, mmap=mmap)
    where = model.w.data_ptr()
    fastload.reload(model, second)
    assert model.w.data_ptr() == where
    _assert_as_safetensors(model.w, second, "w")
    _assert_as_safetensors(model.scale, second, "scale")


def test_a_packed_tensor_torch_cannot_hold_is_refused_naming_it(tmp_path: Path) -> None:
    # 2 x 3 F4 values are 3 whole bytes (a valid file), but torch packs pairs along the last
    # dimension: no float4_e2m1fn_x2 tensor has that shape
    header = json.dumps({"w": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}})
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\x12\x34\x56")
    named = r"odd\.safetensors: tensor 'w': F4 shape \[2, 3\]"
    with pytest.raises(fastload.UnsupportedError, match=named):
        fastload.from_pretrained(Packed, path)
    with pytest.raises(fastload.UnsupportedError, match=named):
        CheckpointWeights([str(path)], VllmLoadOptions())


@pytest.mark.parametrize(
    "options",
    [VllmLoadOptions(mmap="auto"), VllmLoadOptions(mmap="copy"), VllmLoadOptions(staged=True)],
    ids=["views", "copies", "staged"],
)
def test_the_vllm_weight_stream_hands_out_float4_tensors_as_safetensors_reads_them(
    tmp_path: Path, options: VllmLoadOptions
) -> None:
    path = _file(tmp_path)
    stream = CheckpointWeights([str(path)], options)
    got = dict(iter(stream))
    stream.close()
    assert sorted(got) == ["scale", "w"]
    for name, tensor in got.items():
        _assert_as_safetensors(tensor, path, name)


@pytest.mark.parametrize("mmap", ["auto", "copy"])
def test_vllm_weight_loaders_copy_float4_tensors_whole_and_by_rows(
    tmp_path: Path, mmap: str
) -> None:
    """What vLLM's weight loaders do with a packed weight: copy it whole into a parameter, and
    rows of it into a fused parameter (a slice the engine cannot cut: torch copies it)."""
    rows, pairs = 8192, 128  # the rows copied are above the size the watch gives the engine
    assert rows // 2 * pairs >= ENGINE_MIN
    w = _packed(0, rows=rows, pairs=pairs)
    path = tmp_path / "model.safetensors"
    st.save_file({"w": w, "fused": w.clone()}, str(path))
    origins: dict[int, object] = {}
    stream = CheckpointWeights([str(path)], VllmLoadOptions(mmap=mmap), origins=origins)
    params = {
        "w": nn.Parameter(torch.empty(rows, pairs, dtype=w.dtype), requires_grad=False),
        "fused": nn.Parameter(torch.empty(rows // 2, pairs, dtype=w.dtype), requires_grad=False),
    }
    watch = CopyWatch(origins, params.items(), tp_size=1, adopt=True)  # type: ignore[arg-type]
    with watch:
        for name, tensor in stream:
            if name == "w":
                params["w"].data.copy_(tensor)
            else:
                params["fused"].data.copy_(tensor.narrow(0, rows // 4, rows // 2))
    stream.close()
    assert torch.equal(raw_bytes(params["w"]), raw_bytes(w))
    assert torch.equal(raw_bytes(params["fused"]), raw_bytes(w[rows // 4 : rows // 4 + rows // 2]))
