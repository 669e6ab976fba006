"""Loads from many threads at once return what a single-threaded load returns (``load_file`` and
``from_pretrained``), and copies run with the GIL released (two threads loading take clearly less
than twice one thread's time)."""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload
from tensor_samples import assert_bitwise_equal

T = TypeVar("T")
THREADS = 8


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes; the big one spans several copy chunks (``_core.CHUNK``)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(3_000_000, generator=gen),  # 12 MB: more than one chunk
        "proj.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
        "proj.bias": torch.randn(48, generator=gen).to(torch.float16),
        "steps": torch.randint(0, 1000, (7,), generator=gen, dtype=torch.int64),
        "mask": torch.randint(0, 2, (5, 3), generator=gen).bool(),
        "scale": torch.tensor(0.5, dtype=torch.float64),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four checkpoints with different contents."""
    out = tmp_path_factory.mktemp("concurrent")
    paths = []
    for seed in range(4):
        path = out / f"ckpt{seed}.safetensors"
        st_save_file(_checkpoint(seed), str(path), metadata={"format": "pt"})
        paths.append(path)
    return paths


def _in_threads(calls: list[Callable[[], T]]) -> list[T]:
    """Runs every call in its own thread, all released at once; returns results in order."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], T]) -> T:
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def _rounds(calls: list[Callable[[], T]], rounds: int = 3) -> list[T]:
    """:func:`_in_threads` ``rounds`` times over; results of all rounds, in order. A race that a
    single round can miss rarely survives three."""
    return [result for _ in range(rounds) for result in _in_threads(calls)]


def test_eight_threads_loading_the_same_file_get_what_one_thread_gets(files: list[Path]) -> None:
    want = fastload.load_file(files[0], threads=1)
    # Mixed read modes and copy thread counts, so the threads also share the Rust copy pools.
    calls = [
        (
            lambda i=i: fastload.load_file(
                files[0], read_mode=("pread", "mmap")[i % 2], threads=1 + i % 3
            )
        )
        for i in range(THREADS)
    ]
    for got in _in_threads(calls):
        assert_bitwise_equal(got, want)


def test_eight_threads_loading_different_files_each_get_their_own_tensors(
    files: list[Path],
) -> None:
    want = [fastload.load_file(path, threads=1) for path in files]
    calls = [
        (lambda i=i: fastload.load_file(files[i % len(files)], threads=1 + i % 2))
        for i in range(THREADS)
    ]
    for i, got in enumerate(_in_threads(calls)):
        assert_bitwise_equal(got, want[i % len(files)])


def test_eight_threads_converting_on_load_match_a_single_threaded_conversion(
    files: list[Path],
) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    want = {dt: fastload.load_file(files[1], dtype=dt, threads=1) for dt in dtypes}
    calls = [
        (lambda i=i: fastload.load_file(files[1], dtype=dtypes[i % 4], threads=2))
        for i in range(THREADS)
    ]
    for i, got in enumerate(_in_threads(calls)):
        assert_bitwise_equal(got, want[dtypes[i % 4]])


@pytest.fixture(scope="module")
def big_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two 256 MiB checkpoints (one F32 tensor each), read once to warm the page cache."""
    out = tmp_path_factory.mktemp("big")
    paths = []
    for i in range(2):
        path = out / f"big{i}.safetensors"
        st_save_file({"w": torch.full((64 << 20,), float(i))}, str(path))
        fastload.load_file(path, threads=1)
        paths.append(path)
    return paths


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _warm(paths: list[Path]) -> None:
    # Some VMs page out cold page cache on their own (DAMON); a load that hits the disk would
    # measure the disk, not the GIL.
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def _two_vs_one(work: Callable[[Path], object], paths: list[Path]) -> tuple[float, float]:
    """(one run, two concurrent runs), best of 5 interleaved rounds with the page cache re-warmed
    before each, so that passing load from other processes hits neither figure."""

    def sequential() -> None:
        for path in paths:
            work(path)

    def concurrent() -> None:
        _in_threads([lambda p=p: work(p) for p in paths])

    rounds = []
    for _ in range(5):
        _warm(paths)
        one = _timed(sequential) / 2
        _warm(paths)
        rounds.append((one, _timed(concurrent)))
    return min(o for o, _ in rounds), min(c for _, c in rounds)


def test_two_threads_loading_take_clearly_less_than_twice_one_load(big_files: list[Path]) -> None:
    # One copy thread per load: with the GIL released, two Python threads copy on two cores at
    # once; with it held they would take as long as two loads in a row.
    data = bytes(256 << 20)
    # Calibration with work known to release the GIL: on a machine whose second core is busy
    # (other processes), nothing can run two threads at once and the comparison means nothing.
    one, both = _two_vs_one(lambda _: hashlib.sha256(data).digest(), big_files)
    if both > 1.5 * one:
        pytest.skip(f"no second free core: two sha256 threads take {both / one:.2f}x one")
    one, both = _two_vs_one(lambda path: fastload.load_file(path, threads=1), big_files)
    assert both < 1.6 * one, f"2 concurrent loads take {both:.3f}s, one load {one:.3f}s"


def test_python_threads_keep_running_while_a_load_copies(big_files: list[Path]) -> None:
    # Holds on any number of free cores: with the GIL held during the copy, this thread would
    # stand still until the load returns.
    def spin(done: threading.Event) -> float:
        start, turns = time.perf_counter(), 0
        while not done.is_set():
            turns += 1
        return turns / (time.perf_counter() - start)

    timer_done = threading.Event()
    timer = threading.Timer(0.2, timer_done.set)
    timer.start()
    alone = spin(timer_done)
    load_done = threading.Event()

    def load() -> None:
        fastload.load_file(big_files[0], threads=1)
        load_done.set()

    loader = threading.Thread(target=load)
    loader.start()
    during = spin(load_done)
    loader.join()
    assert during > 0.25 * alone, f"{during:.0f} loop turns/s during a load, {alone:.0f} alone"


# --- from_pretrained ------------------------------------------------------------------------------


def _patchable_namespaces() -> list[object]:
    """Where building a skeleton patches functions process-wide: ``nn.Module`` (parameters to
    meta), torch's init functions and transformers' ``init_weights`` (switched off while a
    transformers model is built)."""
    import transformers.initialization as hf_init
    from transformers.modeling_utils import PreTrainedModel

    patched_modules = [sys.modules[m] for m in hf_init.TORCH_MODULES_TO_PATCH if m in sys.modules]
    return [nn.Module, torch.nn.init, PreTrainedModel, *patched_modules]


@pytest.fixture
def torch_globals_restored() -> Iterator[None]:
    """Puts back whatever concurrent loads left patched (and torch's default dtype), so that a
    race caught here does not leave later tests with meta or uninitialized parameters."""
    saved = [(ns, dict(vars(ns))) for ns in _patchable_namespaces()]
    default_dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(default_dtype)
    for ns, attrs in saved:
        for name, value in attrs.items():
            if vars(ns).get(name) is not value:
                setattr(ns, name, value)


@pytest.fixture
def eager_thread_switching() -> Iterator[None]:
    """Python threads switching every few microseconds instead of every 5 ms, so that the short
    Python phases of concurrent loads really interleave (a race shows up on every run)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


class _Net(nn.Module):
    """A small module with a computed (non-persistent) buffer, built on meta by from_pretrained."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)
        self.register_buffer("positions", torch.arange(12), persistent=False)


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


@pytest.fixture(scope="module")
def net_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("nets")
    paths = []
    for seed in range(4):
        path = out / f"net{seed}"
        fastload.save_pretrained(_net(seed), path)
        paths.append(path)
    return paths


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _assert_same_model(got: nn.Module, want: nn.Module) -> None:
    assert_bitwise_equal(_tensors(got), _tensors(want))


@pytest.mark.usefixtures("torch_globals_restored", "eager_thread_switching")
def test_eight_threads_calling_from_pretrained_on_one_checkpoint_get_the_single_threaded_model(
    net_checkpoints: list[Path],
) -> None:
    want = fastload.from_pretrained(_Net, net_checkpoints[0], strict=True)
    calls = [
        (lambda: fastload.from_pretrained(_Net, net_checkpoints[0], strict=True, threads=2))
        for _ in range(THREADS)
    ]
    for got in _rounds(calls):
        _assert_same_model(got, want)


@pytest.mark.usefixtures("torch_globals_restored", "eager_thread_switching")
def test_eight_threads_calling_from_pretrained_on_different_checkpoints_get_their_own_models(
    net_checkpoints: list[Path],
) -> None:
    want = [fastload.from_pretrained(_Net, path, strict=True) for path in net_checkpoints]
    calls = [
        (lambda i=i: fastload.from_pretrained(_Net, net_checkpoints[i % 4], strict=True))
        for i in range(THREADS)
    ]
    for i, got in enumerate(_rounds(calls)):
        _assert_same_model(got, want[i % 4])


@pytest.mark.usefixtures("torch_globals_restored", "eager_thread_switching")
def test_concurrent_from_pretrained_with_different_dtypes_gives_each_caller_its_dtype(
    net_checkpoints: list[Path],
) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    want = {dt: fastload.from_pretrained(_Net, net_checkpoints[1], dtype=dt) for dt in dtypes}
    calls = [
        (lambda i=i: fastload.from_pretrained(_Net, net_checkpoints[1], dtype=dtypes[i % 4]))
        for i in range(THREADS)
    ]
    for i, got in enumerate(_rounds(calls)):
        _assert_same_model(got, want[dtypes[i % 4]])


@pytest.mark.usefixtures("torch_globals_restored", "eager_thread_switching")
def test_concurrent_from_pretrained_leaves_torch_as_it_found_it(
    net_checkpoints: list[Path],
) -> None:
    register_parameter = nn.Module.register_parameter
    default_dtype = torch.get_default_dtype()
    calls = [
        (lambda i=i: fastload.from_pretrained(_Net, net_checkpoints[i % 4], dtype=torch.bfloat16))
        for i in range(THREADS)
    ]
    _rounds(calls)
    assert nn.Module.register_parameter is register_parameter
    assert torch.get_default_dtype() == default_dtype
    assert nn.Linear(2, 2).weight.device.type == "cpu"


@pytest.mark.usefixtures("torch_globals_restored", "eager_thread_switching")
def test_eight_threads_loading_a_transformers_checkpoint_get_the_single_threaded_model(
    tmp_path: Path,
) -> None:
    tiny_models = pytest.importorskip("tiny_models")
    directory = tiny_models.make_checkpoint(tmp_path / "bert", "BertForMaskedLM", seed=3)
    cls = tiny_models.model_class("BertForMaskedLM")
    want = fastload.from_pretrained(cls, directory)
    for got in _rounds([lambda: fastload.from_pretrained(cls, directory)] * THREADS):
        tiny_models.assert_same_tensors(got, want)
