"""The staged path of accelerator loads: one pool of slots per load, a ring of reads ahead of the
copies, cold ranges read past the page cache. CPU destinations run the same code (plain instead
of pinned slots); the CUDA tests skip without a GPU."""

from __future__ import annotations

import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

import fastload
import fastload.core.reads.streaming as streaming
from fastload.core.basics.units import parse_bytes
from fastload.core.memory.page_cache import evict, resident_fraction
from fastload.core.memory.staging import DEFAULT_STAGING_BYTES, StagingPool
from fastload.core.reads import reading
from fastload.core.reads.reading import open_file
from fastload.core.reads.streaming import stream_into

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    """Three files of mixed dtypes, each larger than the small slots the tests use."""
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


def test_one_pool_serves_every_file_of_a_load_with_one_slab(shards: list[Path]) -> None:
    pool = StagingPool(256, 4)
    _fill_all(shards, pool)
    # Three files, each many times the pool: the slots turned over, one slab was ever made.
    assert pool.allocations == 1
    assert pool.peak_bytes == 4 * 256
    assert pool.direct_bytes + pool.cached_bytes >= sum(p.stat().st_size - 200 for p in shards)


def test_a_released_plain_slab_is_made_again_on_next_use(shards: list[Path]) -> None:
    pool = StagingPool(256, 4)
    _fill_all(shards[:1], pool)
    pool.release()
    assert pool.nbytes == 0
    _fill_all(shards[1:], pool)
    assert pool.allocations == 2 and pool.peak_bytes == 1024


def test_a_column_slice_larger_than_half_the_slab_is_gathered_in_a_buffer_of_its_own(
    tmp_path: Path,
) -> None:
    m = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    path = tmp_path / "m.safetensors"
    st_save_file({"m": m}, str(path))
    pool = StagingPool(64, 2)
    cols = torch.empty(8, 4)
    stream_into(open_file(path), [("m", cols, [1, 4, 8])], pool=pool)
    assert torch.equal(cols, m[:, 4:])
    assert pool.allocations == 2  # the slab, and one buffer for the 128-byte slice
    assert pool.peak_bytes == 2 * 64 + 128


def test_rows_go_through_the_ring_and_columns_through_the_engine_both_exact(tmp_path: Path) -> None:
    m = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "m.safetensors"
    st_save_file({"m": m}, str(path))
    rows, cols = torch.empty(15, 24), torch.empty(40, 8, dtype=torch.bfloat16)
    stream_into(
        open_file(path),
        [("m", rows, [0, 20, 35]), ("m", cols, [1, 8, 16])],
        pool=StagingPool(256, 4),
    )
    assert torch.equal(rows, m[20:35])
    assert torch.equal(cols, m[:, 8:16].bfloat16())


def test_conversions_during_the_staged_copy_equal_torchs_own(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    state = {
        "h": torch.randn(333, generator=gen).half(),
        "b": torch.randn(17, 19, generator=gen).bfloat16(),
        "f": torch.randn(1000, generator=gen),
    }
    path = tmp_path / "c.safetensors"
    st_save_file(state, str(path))
    for want in (torch.float32, torch.bfloat16, torch.float16):
        dest = {k: torch.empty(v.shape, dtype=want) for k, v in state.items()}
        stream_into(
            open_file(path), [(k, t, None) for k, t in dest.items()], pool=StagingPool(512, 4)
        )
        for k, v in state.items():
            assert torch.equal(dest[k], v.to(want)), (k, want)


def test_a_tensor_at_an_odd_offset_of_the_file_is_delivered_exactly(tmp_path: Path) -> None:
    # 3 bytes of u8 first: every later tensor starts at an offset no wider dtype divides.
    state = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(50), "c": torch.arange(7)}
    path = tmp_path / "odd.safetensors"
    st_save_file(state, str(path))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    stream_into(open_file(path), [(k, t, None) for k, t in dest.items()], pool=StagingPool(64, 4))
    for k, v in st_load_file(path).items():
        assert torch.equal(dest[k], v), k


@pytest.mark.parametrize(
    ("size", "slots"),
    [
        (None, (16 << 20, 16)),
        (1 << 20, (256 << 10, 4)),
        ("256MiB", (16 << 20, 16)),
        ("1GB", (16 << 20, 10**9 // (16 << 20))),
        (1 << 14, (4096, 4)),
        (1000, (192, 5)),  # slots of whole 64 bytes: aligned for every dtype
        ("10KB", (2496, 4)),
        (300, (64, 4)),
    ],
)
def test_staging_bytes_is_cut_into_slots(size: int | str | None, slots: tuple[int, int]) -> None:
    pool = StagingPool.sized(size)
    assert (pool.slot_bytes, pool.num_slots) == slots
    assert pool.slot_bytes * pool.num_slots <= (DEFAULT_STAGING_BYTES if size is None else 10**10)


@pytest.mark.parametrize("size", ["lots", -5, 0, 100, 255, 1.5, True])
def test_a_staging_size_that_is_not_a_usable_size_is_refused_naming_what_it_needs(
    size: object,
) -> None:
    with pytest.raises(fastload.RequestError, match="staging"):
        StagingPool.sized(size)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1000, "10KB", 300, "5000", 20000])
def test_any_accepted_staging_size_stages_an_ordinary_file_exactly(
    tmp_path: Path, size: int | str
) -> None:
    # slots of sizes no element size divides (250, 2500 bytes) once failed in torch's view of a
    # slot's bytes as the tensor's dtype (storage offset not a multiple of 8): f64 and i64 here,
    # through the ring and through the engine's gathering (the column slice)
    gen = torch.Generator().manual_seed(3)
    state = {
        "a": torch.randn(300, generator=gen),
        "b": torch.randn(7, 9, generator=gen).bfloat16(),
        "c": torch.arange(11, dtype=torch.int64),
        "d": torch.randn(900, generator=gen).double(),
        "m": torch.randn(24, 16, generator=gen).double(),
    }
    path = tmp_path / "f.safetensors"
    st_save_file(state, str(path))
    pool = StagingPool.sized(size)
    assert pool.slot_bytes * pool.num_slots <= parse_bytes(size, where="x")
    dest = {k: torch.empty_like(v) for k, v in state.items() if k != "m"}
    cols = torch.empty(24, 5, dtype=torch.float64)
    items = [(k, t, None) for k, t in dest.items()] + [("m", cols, [1, 3, 8])]
    stream_into(open_file(path), items, pool=pool)  # type: ignore[arg-type]
    for k, v in st_load_file(path).items():
        assert torch.equal(cols if k == "m" else dest[k], v[:, 3:8] if k == "m" else v), k


@pytest.mark.parametrize("slot_bytes", [250, 100, 2500])
def test_a_slot_size_that_is_not_a_multiple_of_64_is_refused(slot_bytes: int) -> None:
    with pytest.raises(fastload.RequestError, match="multiple of 64"):
        StagingPool(slot_bytes, 4)


def test_a_too_small_staging_size_says_the_size_it_needs() -> None:
    with pytest.raises(fastload.RequestError, match="at least 256 bytes"):
        StagingPool.sized(200)


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
    assert report.staging_bytes == 0 and report.bytes_staged_direct == 0


# --- the ring: faults ---------------------------------------------------------------------------


def _stage_threads() -> int:
    """The ring's reading threads alive in this process (named by the engine)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
        except OSError:
            continue
    return sum(n.startswith("fastload-stage") for n in names)


@pytest.fixture
def big(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {
        f"t{i}": torch.randn(64, 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)
    }
    path = tmp_path / "big.safetensors"
    st_save_file(state, str(path))
    return path, state


def test_a_copy_that_raises_stops_the_ring_without_a_hang(big, monkeypatch) -> None:
    path, state = big
    real, calls = streaming._deliver, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected copy failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(streaming, "_deliver", failing)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(RuntimeError, match="injected copy failure"):
        stream_into(
            open_file(path), [(k, t, None) for k, t in dest.items()], pool=StagingPool(4096, 4)
        )
    assert _stage_threads() == 0  # every reader joined before the error propagated


def test_a_file_truncated_during_the_load_names_the_file_and_the_tensor(big) -> None:
    path, state = big
    file = open_file(path)
    os.truncate(path, 100_000)  # inside t0..t1: their bytes are gone
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(fastload.CheckpointError) as info:
        stream_into(file, [(k, t, None) for k, t in dest.items()], pool=StagingPool(4096, 4))
    msg = str(info.value)
    assert str(path) in msg and "tensor 't" in msg and "file changed on disk" in msg, msg
    assert _stage_threads() == 0


def test_a_file_rewritten_in_place_during_the_load_is_refused(big) -> None:
    path, state = big
    file = open_file(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)  # same size, new bytes and modification time
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(fastload.CheckpointError, match="rewritten in place"):
        stream_into(file, [(k, t, None) for k, t in dest.items()], pool=StagingPool(4096, 4))


# --- the ring: which path the bytes took, seen from outside (the page cache) --------------------


def _direct_io_here(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def _kernel_has_cachestat() -> bool:
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 5)


@pytest.fixture
def large(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """24 MiB in 6 tensors: many 1 MiB slots' worth, evictable."""
    gen = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(1024, 1024, generator=gen) for i in range(6)}
    path = tmp_path / "large.safetensors"
    st_save_file(state, str(path))
    if not _direct_io_here(path) or not _kernel_has_cachestat():
        pytest.skip("this filesystem or kernel has no direct I/O or no cachestat(2)")
    return path, state


def test_a_cold_file_is_read_past_the_page_cache_and_leaves_none_of_it_resident(large) -> None:
    path, state = large
    evict(path)
    assert resident_fraction(path) < 0.05, "eviction did not take"
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    pool = StagingPool(1 << 20, 4)
    stream_into(open_file(path), [(k, t, None) for k, t in dest.items()], pool=pool)
    for k, v in state.items():
        assert torch.equal(dest[k], v), k
    total = sum(v.numel() * 4 for v in state.values())
    assert pool.direct_bytes >= 0.9 * total, (pool.direct_bytes, pool.cached_bytes)
    assert resident_fraction(path) < 0.05


def test_a_cached_file_is_copied_out_of_the_page_cache(large) -> None:
    path, state = large
    path.read_bytes()  # every page cached
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    pool = StagingPool(1 << 20, 4)
    stream_into(open_file(path), [(k, t, None) for k, t in dest.items()], pool=pool)
    assert pool.cached_bytes >= sum(v.numel() * 4 for v in state.values())
    assert pool.direct_bytes == 0
    assert all(torch.equal(dest[k], v) for k, v in state.items())


def test_direct_false_reads_a_cold_file_through_the_page_cache(large) -> None:
    path, state = large
    evict(path)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    pool = StagingPool(1 << 20, 4)
    stream_into(open_file(path), [(k, t, None) for k, t in dest.items()], pool=pool, direct=False)
    assert pool.direct_bytes == 0
    assert resident_fraction(path) > 0.9


# --- CUDA ---------------------------------------------------------------------------------------


@needs_cuda
def test_safe_open_to_cuda_pins_one_pool_for_all_its_get_tensor_calls(shards: list[Path]) -> None:
    with fastload.safe_open(shards[0], device="cuda", staging_bytes=1 << 12) as f:
        for name in f.keys():
            assert torch.equal(f.get_tensor(name).cpu(), fastload.load_file(shards[0])[name])
        assert f.staging.allocations <= 1 and f.staging.pinned


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
    assert report.staging_bytes == 1 << 14  # four 4 KiB slots for every shard
    for key, value in layers.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value), key


def test_an_accelerator_load_counts_its_staging_slots_against_the_memory_budget() -> None:
    # the budget check runs before anything is allocated, for any device: here a plan whose one
    # tensor goes to an accelerator, against a budget smaller than the pool
    from types import SimpleNamespace

    from fastload.core.memory.budget import MemoryBudget
    from fastload.core.plan.actions import Action, Mode
    from fastload.core.plan.owned_memory import check_owned_memory

    dest = SimpleNamespace(device=torch.device("cuda", 0), tensor=None, dtype=torch.bfloat16)
    source = SimpleNamespace(mode=Mode.COPY, dest=dest, stored=None, nbytes=1 << 20)
    plan = SimpleNamespace(
        groups=[SimpleNamespace(action=Action.LOAD, pieces=None, sources=[source])]
    )
    pool = StagingPool.sized("64MiB")
    with pytest.raises(fastload.MemoryBudgetError, match=r"64\.0 MiB.*pinned staging slots"):
        check_owned_memory(plan, "auto", pool, MemoryBudget(available=32 << 20, source="test"))
    check_owned_memory(plan, "auto", pool, MemoryBudget(available=128 << 20, source="test"))


# --- one safe_open handle shared by threads -----------------------------------------------------


def _two_threads_read_one_handle(path: Path, device: str) -> tuple[list[str], fastload.SafeOpen]:
    """Two threads each read their own half of ``path``'s tensors from one handle, many times;
    returns the names whose values differed from safetensors' (and the closed handle)."""
    want = st_load_file(path)
    names = sorted(want)
    halves = [names[0::2], names[1::2]]
    start = threading.Barrier(2)

    def read(mine: list[str]) -> list[str]:
        start.wait(timeout=60)
        wrong = []
        for _ in range(40):
            for name in mine:
                if not torch.equal(f.get_tensor(name).cpu(), want[name]):
                    wrong.append(name)
        return wrong

    # 4 slots of 1 KiB: every tensor takes several fills of the ring, the slots turn over often
    # mmap="copy": on the CPU, get_tensor would otherwise hand out views of the file (no read)
    with fastload.safe_open(path, device=device, staging_bytes=4096, mmap="copy") as f:
        with ThreadPoolExecutor(2) as pool:
            wrong = [name for found in pool.map(read, halves) for name in found]
    return wrong, f


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(4)
    state = {f"f{i}": torch.randn(3000 + 17 * i, generator=gen) for i in range(4)}
    state |= {f"b{i}": torch.randn(50, 61 + i, generator=gen).bfloat16() for i in range(2)}
    state["i"] = torch.arange(2000, dtype=torch.int64) * 7
    path = tmp_path / "mixed.safetensors"
    st_save_file(state, str(path))
    return path


def test_two_threads_sharing_one_safe_open_handle_read_the_right_values(
    mixed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the handle's one staging pool serves both threads' reads; CPU destinations are forced
    # through the staged path (what every get_tensor to an accelerator takes)
    def staged(file, items, threads=None, pool=None, progress=None):  # noqa: ANN001, ANN202
        return stream_into(file, list(items), pool=pool, threads=threads, progress=progress)

    monkeypatch.setattr(reading, "fill", staged)  # get_tensor's read: fastload.core.reads.reading
    wrong, f = _two_threads_read_one_handle(mixed, "cpu")
    assert wrong == []
    assert f.staging.allocations == 1
    assert f.staging.direct_bytes + f.staging.cached_bytes > 0  # the reads were staged


@needs_cuda
def test_two_threads_sharing_one_cuda_safe_open_handle_read_the_right_values(mixed: Path) -> None:
    wrong, f = _two_threads_read_one_handle(mixed, "cuda")
    assert wrong == []
    assert f.staging.allocations <= 1  # one pinned slab (or the process's cached one) for both
