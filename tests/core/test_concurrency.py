"""Loads from many threads at once return what a single-threaded load returns (``load_file`` and
``from_pretrained``), and copies run with the GIL released (another Python thread watches a copy's
progress and cancels it while it runs; signal handlers run during a copy). Nothing here measures
time: the speed of concurrent loads is a benchmark figure (``benches/gil_release.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from tensor_samples import assert_bitwise_equal
from torch import nn

import fastload
from fastload import _core
from fastload.core.basics.engine import copy_into

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
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 256 MiB checkpoint (one F32 tensor): 32 copy pieces of ``_core.CHUNK``. Large enough
    that a thread woken late on a loaded machine still finds the copy under way."""
    path = tmp_path_factory.mktemp("big") / "big.safetensors"
    st_save_file({"w": torch.full((BIG,), 1.0)}, str(path))
    return path


BIG = 64 << 20  # elements of big_file's tensor
ROUNDS = 20
#: how long a waiting thread sleeps between looks at a copy's progress: a sleeping poller leaves
#: the CPU (and the GIL) to the threads it waits for, which a spinning one does not
POLL = 0.0002


def _copy_job(file: _core.SafetensorsFile, dest: torch.Tensor) -> list[Any]:
    return [("w", dest, "F32", None)]


def test_another_python_thread_runs_and_can_cancel_while_a_copy_is_under_way(
    big_file: Path,
) -> None:
    # The main thread sees the copy's byte counter strictly between 0 and the total, and cancels
    # the copy there: only possible if the copying thread released the GIL. A round whose copy
    # finished before the main thread looked proves nothing either way and is retried.
    file = _core.SafetensorsFile(str(big_file))
    dest = torch.empty(BIG)
    total = dest.numel() * dest.element_size()
    cancelled = 0
    for _ in range(ROUNDS):
        progress = _core.Progress()
        errors: list[BaseException] = []

        def load(progress: _core.Progress = progress, errors: list[BaseException] = errors) -> None:
            try:
                copy_into(file, _copy_job(file, dest), 1, progress)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                errors.append(e)

        loader = threading.Thread(target=load)
        loader.start()
        while loader.is_alive() and not 0 < progress.done < total:
            time.sleep(POLL)
        if 0 < progress.done < total:
            progress.cancel()
        loader.join()
        if errors:
            assert len(errors) == 1 and isinstance(errors[0], fastload.LoadCancelledError)
            assert "[cancelled]" in str(errors[0]) and str(big_file) in str(errors[0])
            assert progress.cancelled and progress.done < total
            cancelled += 1
            break
        else:
            # Finished before the main thread looked, or its last piece before the cancel.
            assert progress.done == total
    assert cancelled >= 1, f"no round of {ROUNDS} saw the copy under way"


class _Interrupted(Exception):
    pass


def test_a_signal_during_a_copy_runs_its_python_handler_and_stops_the_copy(
    big_file: Path,
) -> None:
    # Ctrl-C: the copying (main) thread runs signal handlers while the copy is under way; the
    # handler's exception cancels the copy and comes out of copy_into.
    file = _core.SafetensorsFile(str(big_file))
    dest = torch.empty(BIG)
    total = dest.numel() * dest.element_size()
    interrupted = 0
    for _ in range(ROUNDS):
        progress = _core.Progress()

        def handler(signum: int, frame: object, progress: _core.Progress = progress) -> None:
            if progress.done < total:  # a late signal after the copy must not raise elsewhere
                raise _Interrupted

        def send(progress: _core.Progress = progress) -> None:
            while progress.done == 0:
                time.sleep(POLL)
            if progress.done < total:
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        old = signal.signal(signal.SIGINT, handler)
        sender = threading.Thread(target=send)
        try:
            sender.start()
            try:
                copy_into(file, _copy_job(file, dest), 1, progress)
            except _Interrupted:
                # Cancelled; its last pieces may have finished before the cancel was seen.
                assert progress.cancelled
                interrupted += 1
            sender.join()
        finally:
            signal.signal(signal.SIGINT, old)
        if interrupted:
            break
    assert interrupted >= 1, f"no round of {ROUNDS} was interrupted during its copy"


CTRL_C = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from fastload import _core
    from fastload.core.basics.engine import copy_into
    # Python leaves SIGINT ignored if it started that way (a background job of a shell script):
    # install the handler an interactive Python has, the one Ctrl-C reaches
    signal.signal(signal.SIGINT, signal.default_int_handler)
    file = _core.SafetensorsFile(sys.argv[1])
    dest = torch.empty(int(sys.argv[2]))
    total = dest.numel() * dest.element_size()
    job = [("w", dest, "F32", None)]
    for _ in range(20):
        progress = _core.Progress()
        def press(progress=progress):
            while progress.done == 0:
                time.sleep(0.0002)
            if progress.done < total:
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
        sender = threading.Thread(target=press)
        try:
            sender.start()
            try:
                copy_into(file, job, 1, progress)
            except KeyboardInterrupt:
                print("interrupted", progress.cancelled)
                break
            sender.join()
        except KeyboardInterrupt:
            sender.join()  # arrived after the copy had finished: try again
    """
)


def test_ctrl_c_during_a_copy_raises_keyboard_interrupt_and_stops_the_copy(
    big_file: Path,
) -> None:
    # Python's own SIGINT handler in a process of its own: KeyboardInterrupt comes out of the
    # copy, which was cancelled before its end.
    out = subprocess.run(
        [sys.executable, "-c", CTRL_C, str(big_file), str(BIG)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "interrupted True" in out.stdout, out.stdout + out.stderr


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
