"""The staging pool of accelerator loads: one pool per load (not per file, device or tensor),
buffers allocated on first use, host memory bounded by its size. CPU destinations exercise the
same code (plain instead of pinned buffers); the CUDA tests skip without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file

import fastload
from fastload.core.reading import open_file
from fastload.core.streaming import DEFAULT_STAGING_BYTES, StagingPool, stream_into

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    """Three files of mixed dtypes, each larger than the small buffers the tests use."""
    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(3):
        path = tmp_path / f"s{i}.safetensors"
        st_save_file(
            {
                f"a{i}": torch.randn(300, generator=gen),
                f"b{i}": torch.randn(7, 9, generator=gen).to(torch.bfloat16),
                f"c{i}": torch.arange(11, dtype=torch.int64),
            },
            str(path),
        )
        paths.append(path)
    return paths


def _fill_all(paths: list[Path], pool: StagingPool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        want = fastload.load_file(path)
        dest = {k: torch.empty_like(v) for k, v in want.items()}
        stream_into(open_file(path), [(k, t, None) for k, t in dest.items()], pool=pool)
        for k, v in want.items():
            assert torch.equal(dest[k], v), k
        out |= dest
    return out


def test_a_pool_allocates_nothing_until_it_is_used() -> None:
    pool = StagingPool(1024, 2)
    assert pool.nbytes == 0 and pool.allocations == 0 and pool.peak_bytes == 0


def test_one_pool_serves_every_file_of_a_load_with_its_own_buffers(shards: list[Path]) -> None:
    pool = StagingPool(256, 2)
    _fill_all(shards, pool)
    # Three files, many buffer turns each: still only the pool's two buffers were ever made.
    assert pool.allocations == 2
    assert pool.peak_bytes == 2 * 256


def test_released_buffers_are_made_again_on_next_use(shards: list[Path]) -> None:
    pool = StagingPool(256, 2)
    _fill_all(shards[:1], pool)
    pool.release()
    assert pool.nbytes == 0
    _fill_all(shards[1:], pool)
    assert pool.allocations == 4 and pool.peak_bytes == 512


def test_a_slice_larger_than_a_buffer_gets_one_transient_buffer_counted_in_the_peak(
    tmp_path: Path,
) -> None:
    m = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    path = tmp_path / "m.safetensors"
    st_save_file({"m": m}, str(path))
    pool = StagingPool(64, 2)
    cols = torch.empty(8, 4)
    stream_into(open_file(path), [("m", cols, [1, 4, 8])], pool=pool)
    assert torch.equal(cols, m[:, 4:])
    assert pool.allocations == 3  # the pool's two, and one for the 128-byte slice
    assert pool.peak_bytes == 2 * 64 + 128


@pytest.mark.parametrize(
    ("size", "buffer_bytes"),
    [
        (None, DEFAULT_STAGING_BYTES // 2),
        (1 << 20, 1 << 19),
        ("256MiB", 128 << 20),
        ("1GB", 5 * 10**8),
    ],
)
def test_staging_bytes_is_split_into_two_buffers(size: int | str | None, buffer_bytes: int) -> None:
    pool = StagingPool.sized(size)
    assert (pool.buffer_bytes, pool.num_buffers) == (buffer_bytes, 2)


@pytest.mark.parametrize("size", ["lots", -5, 0, 100, 1.5, True])
def test_a_staging_size_that_is_not_a_usable_size_is_refused(size: object) -> None:
    with pytest.raises(fastload.RequestError, match="staging"):
        StagingPool.sized(size)  # type: ignore[arg-type]


def test_from_pretrained_refuses_a_bad_staging_size_before_reading(shards: list[Path]) -> None:
    with pytest.raises(fastload.RequestError, match="staging_bytes"):
        fastload.from_pretrained(torch.nn.Module, shards[0], staging_bytes="a lot")


def test_a_cpu_load_stages_nothing(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    path = tmp_path / "lin.safetensors"
    st_save_file(dict(model.state_dict()), str(path))
    _, report = fastload.from_pretrained(
        lambda: torch.nn.Linear(4, 3), path, output_loading_info=True
    )
    assert report.staging_bytes == 0


@needs_cuda
def test_safe_open_to_cuda_pins_one_pool_for_all_its_get_tensor_calls(shards: list[Path]) -> None:
    with fastload.safe_open(shards[0], device="cuda", staging_bytes=1 << 12) as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name).cpu(), fastload.load_file(shards[0])[name])
        assert f.staging.allocations == 2


@needs_cuda
def test_a_sharded_cuda_load_stages_every_shard_through_one_bounded_pool(tmp_path: Path) -> None:
    layers = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    fastload.save_pretrained(layers, tmp_path / "ckpt", max_shard_size="40KB")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    model, report = fastload.from_pretrained(
        lambda: torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]),
        tmp_path / "ckpt",
        device="cuda",
        staging_bytes=1 << 14,
        output_loading_info=True,
    )
    assert report.staging_bytes == 1 << 14  # two 8 KiB buffers for every shard
    for key, value in layers.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value), key
