"""fastload's safetensors API against safetensors itself: same bytes, same tensors, same
exception classes, for the torch API (``safe_open``, ``load``/``save``, ``*_file``, ``*_model``)."""

from __future__ import annotations

import errno

import pytest
import safetensors.torch as st
import torch
from tensor_samples import assert_bitwise_equal, raw_bytes
from torch import nn

import fastload
import safetensors
from fastload.core.basics.dtypes import ST_TO_TORCH


def _sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(6, 10, generator=gen),
        "b": torch.randn(10, generator=gen).to(torch.bfloat16),
        "i": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "s": torch.tensor(7.5, dtype=torch.float16),
        "e": torch.empty(0, 3),
    }


@pytest.fixture
def sample_file(tmp_path) -> str:
    path = tmp_path / "sample.safetensors"
    st.save_file(_sample(), str(path), metadata={"format": "pt"})
    return str(path)


def test_save_returns_the_bytes_safetensors_writes() -> None:
    assert fastload.save(_sample(), {"format": "pt"}) == st.save(_sample(), {"format": "pt"})
    assert fastload.save(_sample()) == st.save(_sample())


def test_save_file_writes_the_bytes_safetensors_writes(tmp_path) -> None:
    fastload.save_file(_sample(), tmp_path / "a.safetensors", {"k": "v"})
    st.save_file(_sample(), str(tmp_path / "b.safetensors"), {"k": "v"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_load_of_bytes_equals_safetensors_load() -> None:
    data = st.save(_sample())
    assert_bitwise_equal(fastload.load(data), st.load(data), same_order=False)


def test_keys_offset_keys_and_metadata_are_those_of_safetensors(sample_file) -> None:
    with fastload.safe_open(sample_file) as f, safetensors.safe_open(sample_file, "pt") as g:
        assert f.keys() == g.keys()
        assert f.offset_keys() == g.offset_keys()
        assert f.metadata() == g.metadata()


def test_get_tensors_equals_safetensors_get_tensors(sample_file) -> None:
    with fastload.safe_open(sample_file) as f, safetensors.safe_open(sample_file, "pt") as g:
        assert_bitwise_equal(f.get_tensors(), g.get_tensors(), same_order=False)


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_backend_chooses_the_read_path(sample_file, backend) -> None:
    with fastload.safe_open(sample_file, "pt", "cpu", backend=backend) as f:
        assert f.file.mode == backend
    assert fastload.load_file(sample_file, backend=backend).keys() == _sample().keys()


def test_a_backend_that_contradicts_read_mode_is_refused(sample_file) -> None:
    with pytest.raises(fastload.RequestError, match="disagree"):
        fastload.safe_open(sample_file, backend="mmap", read_mode="pread")
    with pytest.raises(fastload.RequestError, match="backend"):
        fastload.load_file(sample_file, backend="io_uring")


INDICES = [
    (slice(None),),
    (slice(1, 4),),
    (slice(None), slice(2, 5)),
    (2, slice(None)),
    (slice(None), -1),
    (-6, 3),
    (slice(1, 5), slice(0, 10, 3)),
    (slice(-3, None), slice(None, -2)),
    (Ellipsis, 4),
    (),
    ([],),
]


@pytest.mark.parametrize("index", INDICES, ids=repr)
def test_get_slice_equals_torch_indexing_of_the_whole_tensor(sample_file, index) -> None:
    whole = _sample()["w"]
    with fastload.safe_open(sample_file) as f:
        got = f.get_slice("w")[index]
    want = whole[index]
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize(
    "index", [(slice(None), slice(2, 5)), (2, slice(None)), (slice(1, 4),)], ids=repr
)
def test_get_slice_equals_safetensors_get_slice(sample_file, index) -> None:
    with fastload.safe_open(sample_file) as f, safetensors.safe_open(sample_file, "pt") as g:
        assert torch.equal(f.get_slice("w")[index], g.get_slice("w")[index])
        assert f.get_slice("b").get_shape() == g.get_slice("b").get_shape() == [10]
        assert f.get_slice("b").get_dtype() == g.get_slice("b").get_dtype() == "BF16"


def test_get_slice_reads_only_the_selected_columns(sample_file, monkeypatch) -> None:
    read: list[int] = []
    with fastload.safe_open(sample_file) as f:
        original = f.fill

        def counting(items):
            items = list(items)
            read.extend(dest.numel() for _, dest, _ in items)
            return original(items)

        monkeypatch.setattr(f, "fill", counting)
        column = f.get_slice("w")[:, 7]
    assert torch.equal(column, _sample()["w"][:, 7])
    assert read == [6]  # one element per row, not the 60 of the tensor


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ((slice(None), 20), "index 20 is out of bounds for dimension 1 with size 10"),
        ((0, 0, 0), "too many indices for tensor of dimension 2"),
    ],
    ids=repr,
)
def test_an_index_outside_the_tensor_is_an_index_error_naming_the_file(
    sample_file, index, message
) -> None:
    # safetensors 0.8 indexes with torch: an IndexError in torch's words (fastload's is also a
    # RequestError) and, here, the file's path
    with fastload.safe_open(sample_file) as f, pytest.raises(fastload.RequestError) as info:
        f.get_slice("w")[index]
    assert isinstance(info.value, IndexError)
    assert message in str(info.value) and sample_file in str(info.value)


def test_a_slice_bound_past_the_tensor_is_clamped_as_in_safetensors(sample_file) -> None:
    with fastload.safe_open(sample_file) as f:
        assert torch.equal(f.get_slice("w")[:20], _sample()["w"])


def test_get_slice_of_an_unknown_name_is_a_tensor_not_found_error(sample_file) -> None:
    with fastload.safe_open(sample_file) as f, pytest.raises(fastload.TensorNotFoundError):
        f.get_slice("nope")


# Every dtype safetensors 0.8 defines that torch also has, F4 and the FNUZ fp8 types included.
TORCH_DTYPES = sorted(ST_TO_TORCH)


def _one_of(st_dtype: str) -> torch.Tensor:
    dtype = ST_TO_TORCH[st_dtype]
    # Bytes reinterpreted: fp8/fp4 types have no random generators or comparisons.
    return (
        torch.arange(8, dtype=torch.uint8).reshape(2, 4).mul(37).view(dtype)
        if (dtype.itemsize == 1)
        else torch.arange(8).reshape(2, 4).to(dtype)
    )


@pytest.mark.parametrize("st_dtype", TORCH_DTYPES)
def test_every_dtype_reads_back_as_safetensors_reads_it(tmp_path, st_dtype) -> None:
    t = {"x": _one_of(st_dtype)}
    st.save_file(t, str(tmp_path / "st.safetensors"))
    fastload.save_file(t, tmp_path / "fl.safetensors")
    assert (tmp_path / "st.safetensors").read_bytes() == (tmp_path / "fl.safetensors").read_bytes()
    got = fastload.load_file(tmp_path / "st.safetensors")["x"]
    want = st.load_file(str(tmp_path / "st.safetensors"))["x"]
    assert got.dtype == want.dtype == t["x"].dtype and got.shape == want.shape
    assert torch.equal(raw_bytes(got), raw_bytes(want))


def test_a_file_of_every_dtype_at_once_is_laid_out_as_safetensors_lays_it_out(tmp_path) -> None:
    tensors = {f"t_{name}": _one_of(name) for name in TORCH_DTYPES}
    assert fastload.save(tensors) == st.save(tensors)


def test_f4_keeps_safetensors_shape_convention(tmp_path) -> None:
    packed = torch.zeros(3, 2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "f4.safetensors"
    fastload.save_file({"p": packed}, path)
    with fastload.safe_open(path) as f:
        assert list(f.shape("p")) == [3, 4]  # the header counts 4-bit values
        assert f.get_tensor("p").shape == (3, 2)  # torch counts packed pairs


def test_a_missing_file_is_file_not_found_with_errno_as_in_safetensors(tmp_path) -> None:
    missing = str(tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError) as ours:
        fastload.safe_open(missing)
    with pytest.raises(FileNotFoundError) as theirs:
        safetensors.safe_open(missing, "pt")
    assert ours.value.errno == errno.ENOENT and ours.value.filename == missing
    assert str(ours.value) == str(theirs.value)
    assert isinstance(ours.value, fastload.FastloadIOError)


def test_a_path_through_a_file_is_not_a_directory_error(sample_file) -> None:
    with pytest.raises(NotADirectoryError) as info:
        fastload.load_file(sample_file + "/inner.safetensors")
    assert info.value.errno == errno.ENOTDIR and isinstance(info.value, fastload.FastloadError)


def test_fastload_errors_are_caught_by_except_safetensor_error(sample_file) -> None:
    assert fastload.SafetensorError is fastload.FastloadError
    with fastload.safe_open(sample_file) as f, pytest.raises(fastload.SafetensorError):
        f.get_tensor("nope")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a


def test_save_model_writes_what_safetensors_save_model_writes(tmp_path) -> None:
    model = _Tied()
    fastload.save_model(model, tmp_path / "fl.safetensors")
    st.save_model(model, str(tmp_path / "st.safetensors"))
    with fastload.safe_open(tmp_path / "fl.safetensors") as f:
        assert f.metadata() == {"b.bias": "a.bias", "b.weight": "a.weight"}
        assert f.keys() == ["a.bias", "a.weight"]
    assert_bitwise_equal(
        fastload.load_file(tmp_path / "fl.safetensors"),
        st.load_file(str(tmp_path / "st.safetensors")),
        same_order=False,
    )


def test_load_model_fills_the_model_and_reports_like_safetensors(tmp_path) -> None:
    source = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    path = tmp_path / "m.safetensors"
    state = source.state_dict()
    state["extra"] = torch.ones(2)
    del state["2.bias"]
    st.save_file(state, str(path))
    ours_model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    theirs_model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    ours = fastload.load_model(ours_model, path, strict=False)
    theirs = st.load_model(theirs_model, str(path), strict=False)
    assert sorted(ours[0]) == sorted(theirs[0]) and sorted(ours[1]) == sorted(theirs[1])
    assert torch.equal(ours_model[0].weight, source[0].weight)
    with pytest.raises(RuntimeError, match="Missing key"):
        fastload.load_model(ours_model, path)


def test_load_model_refuses_a_shape_that_differs_from_the_model(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    st.save_file({"weight": torch.ones(2, 3), "bias": torch.ones(2)}, str(path))
    model = nn.Linear(4, 2)
    before = model.weight.detach().clone()
    with pytest.raises(fastload.ModelMismatchError, match="size mismatch for weight") as info:
        fastload.load_model(model, path)
    assert isinstance(info.value, RuntimeError)
    assert torch.equal(model.weight, before)
