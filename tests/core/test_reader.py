"""fastload.load_file / safe_open against safetensors' own loader, bitwise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file
from tensor_samples import assert_bitwise_equal, every_dtype_tensors

import fastload

READ_MODES = ["pread", "mmap"]


@pytest.fixture(scope="module")
def every_dtype_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tensor of every dtype torch and safetensors share, plus 0-d and empty tensors."""
    tensors = every_dtype_tensors()
    path = tmp_path_factory.mktemp("dtypes") / "all.safetensors"
    st_save_file(tensors, str(path), metadata={"format": "pt", "note": "every dtype"})
    return str(path)


@pytest.mark.parametrize("read_mode", READ_MODES)
def test_load_file_equals_safetensors_bitwise_for_every_dtype(every_dtype_file, read_mode):
    got = fastload.load_file(every_dtype_file, read_mode=read_mode)
    assert_bitwise_equal(got, st_load_file(every_dtype_file))


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_load_file_equals_safetensors_for_a_thousand_tensors(tmp_path, threads):
    gen = torch.Generator().manual_seed(1)
    tensors = {f"layer.{i}.w": torch.randn(i % 17 + 1, 7, generator=gen) for i in range(1000)}
    path = tmp_path / "many.safetensors"
    st_save_file(tensors, str(path))
    assert_bitwise_equal(fastload.load_file(path, threads=threads), st_load_file(str(path)))


def test_large_tensors_split_across_threads_load_exactly(tmp_path):
    # 40 MB: larger than the engine's 8 MiB task size, so one tensor is copied by several threads.
    big = torch.randn(10_000_000, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "big.safetensors"
    st_save_file({"big": big, "tail": torch.arange(3)}, str(path))
    for mode in READ_MODES:
        got = fastload.load_file(path, read_mode=mode, threads=2)
        assert torch.equal(got["big"], big) and torch.equal(got["tail"], torch.arange(3))


@pytest.mark.parametrize("read_mode", READ_MODES)
@pytest.mark.parametrize(
    ("stored", "wanted"),
    [
        (s, w)
        for s in ("float32", "float16", "bfloat16", "float64")
        for w in ("float32", "float16", "bfloat16", "float64")
        if s != w
    ],
)
def test_dtype_conversion_during_copy_matches_torch(tmp_path, read_mode, stored, wanted):
    src = (torch.randn(3000, generator=torch.Generator().manual_seed(3)) * 100).to(
        getattr(torch, stored)
    )
    path = tmp_path / "conv.safetensors"
    st_save_file({"x": src, "i": torch.arange(4)}, str(path))
    got = fastload.load_file(path, dtype=getattr(torch, wanted), read_mode=read_mode)
    assert got["x"].dtype == getattr(torch, wanted)
    assert torch.equal(got["x"], src.to(getattr(torch, wanted)))
    assert got["i"].dtype == torch.int64  # integers keep their dtype


def test_safe_open_reads_keys_metadata_and_single_tensors(every_dtype_file):
    want = st_load_file(every_dtype_file)
    with fastload.safe_open(every_dtype_file, framework="pt") as f:
        assert f.keys() == sorted(want)
        assert f.metadata() == {"format": "pt", "note": "every dtype"}
        assert f.dtype("t_BF16") == torch.bfloat16
        assert f.shape("t_F32") == torch.Size([3, 5])
        assert torch.equal(f.get_tensor("t_F32"), want["t_F32"])
        assert torch.equal(f.get_tensor("t_BF16", dtype=torch.float32), want["t_BF16"].float())
        assert torch.equal(f.get_tensor("t_I32", dtype=torch.float32), want["t_I32"].float())


def test_load_into_fills_existing_tensors_including_non_contiguous_ones(every_dtype_file):
    want = st_load_file(every_dtype_file)
    dest = {"t_F32": torch.empty(5, 3).t(), "t_BF16": torch.empty(3, 5, dtype=torch.float32)}
    assert not dest["t_F32"].is_contiguous()
    with fastload.safe_open(every_dtype_file) as f:
        f.load_into(dest)
    assert torch.equal(dest["t_F32"], want["t_F32"])
    assert torch.equal(dest["t_BF16"], want["t_BF16"].float())


def test_a_destination_of_the_wrong_size_is_refused_before_anything_is_written(every_dtype_file):
    dest = {"t_F32": torch.zeros(3, 5), "t_F64": torch.zeros(2, 2, dtype=torch.float64)}
    with fastload.safe_open(every_dtype_file) as f, pytest.raises(fastload.RequestError) as info:
        f.load_into(dest)
    assert "t_F64" in str(info.value) and every_dtype_file in str(info.value)
    assert torch.count_nonzero(dest["t_F32"]) == 0


def test_an_unknown_tensor_name_is_a_key_error_naming_the_file(every_dtype_file):
    with fastload.safe_open(every_dtype_file) as f:
        with pytest.raises(fastload.TensorNotFoundError) as info:
            f.get_tensor("nope")
    assert isinstance(info.value, KeyError)
    assert "nope" in str(info.value) and every_dtype_file in str(info.value)


def test_a_missing_file_is_an_os_error_in_the_hierarchy(tmp_path):
    with pytest.raises(fastload.FastloadIOError) as info:
        fastload.load_file(tmp_path / "absent.safetensors")
    assert isinstance(info.value, OSError) and "absent.safetensors" in str(info.value)


def test_an_unknown_read_mode_is_refused(every_dtype_file):
    with pytest.raises(fastload.RequestError, match="read_mode"):
        fastload.load_file(every_dtype_file, read_mode="magic")


def test_the_staging_pipeline_with_small_buffers_fills_cpu_destinations(every_dtype_file):
    from fastload.core.memory.staging import StagingPool
    from fastload.core.reads.reading import open_file
    from fastload.core.reads.streaming import stream_into

    want = st_load_file(every_dtype_file)
    dest = {k: torch.empty_like(v) for k, v in want.items()}
    written = stream_into(
        open_file(every_dtype_file),
        [(k, t, None) for k, t in dest.items()],
        pool=StagingPool(64, 2),
    )
    assert written == sum(t.numel() * t.element_size() for t in dest.values())
    assert_bitwise_equal(dest, {k: want[k] for k in dest})


def test_slices_along_a_dimension_read_only_the_selected_rows_or_columns(tmp_path):
    from fastload.core.reads.reading import fill, open_file

    m = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    path = tmp_path / "m.safetensors"
    st_save_file({"m": m}, str(path))
    f = open_file(path)
    rows, cols = torch.empty(3, 8), torch.empty(6, 4, dtype=torch.bfloat16)
    fill(f, [("m", rows, [0, 3, 6]), ("m", cols, [1, 4, 8])])
    assert torch.equal(rows, m[3:])
    assert torch.equal(cols, m[:, 4:].bfloat16())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_file_to_cuda_equals_safetensors(every_dtype_file):
    got = fastload.load_file(every_dtype_file, device="cuda")
    want = st_load_file(every_dtype_file, device="cuda")
    assert_bitwise_equal(
        {k: v.cpu() for k, v in got.items()}, {k: v.cpu() for k, v in want.items()}
    )


def test_a_slice_larger_than_a_staging_buffer_is_staged_in_one_of_its_own(tmp_path):
    from fastload.core.memory.staging import StagingPool
    from fastload.core.reads.reading import open_file
    from fastload.core.reads.streaming import stream_into

    m = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    path = tmp_path / "m.safetensors"
    st_save_file({"m": m}, str(path))
    cols = torch.empty(6, 4)
    stream_into(open_file(path), [("m", cols, [1, 4, 8])], pool=StagingPool(64, 2))
    assert torch.equal(cols, m[:, 4:])


def test_a_meta_destination_is_refused_rather_than_left_unfilled(every_dtype_file):
    with (
        fastload.safe_open(every_dtype_file) as f,
        pytest.raises(fastload.RequestError, match="meta"),
    ):
        f.load_into({"t_F32": torch.empty(3, 5, device="meta")})


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_a_thread_count_that_is_not_a_positive_int_is_refused(every_dtype_file, threads):
    with pytest.raises(fastload.RequestError, match="threads"):
        fastload.load_file(every_dtype_file, threads=threads)


def test_load_into_fills_parameters_that_require_grad(every_dtype_file):
    want = st_load_file(every_dtype_file)
    param = torch.nn.Parameter(torch.empty(5, 3).t())  # non-contiguous, requires grad
    with fastload.safe_open(every_dtype_file) as f:
        f.load_into({"t_F32": param})
    assert torch.equal(param.detach(), want["t_F32"])
