"""Tensor-parallel ranks reading the ``weights`` option's checkpoint from object storage, without
vLLM: the weight stream hands tensors out unread, and what a vLLM weight loader does with them
(narrow to this rank's rows or columns and copy, copy whole, or compute with them) fetches exactly
what it reads, counted by a proxy in front of the S3 server (from outside fastload). Against the
local S3-compatible server of tests/support/s3_server.py; the same under a real vLLM engine:
tests/integrations/test_vllm.py."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from s3_server import FaultProxy, S3Server

from fastload import FastloadError
from fastload.core.basics.progress import DISABLE_VARS
from fastload.integrations.vllm.adopt import CopyWatch
from fastload.integrations.vllm.remote import RemoteWeights
from fastload.integrations.vllm.weights import Origin
from fastload.safetensors.saving import save_file

ROWS, COLS = 64, 1024  # bf16: 2 KiB a row


@pytest.fixture
def stored(env: S3Server, tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
        "o": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
        "norm": torch.randn(COLS, generator=g).to(torch.bfloat16),
        "ids": torch.arange(ROWS * 4, dtype=torch.int64).reshape(ROWS, 4),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    url = env.upload(tmp_path / "model.safetensors", "models", "slices/model.safetensors")
    return url, tensors


@pytest.fixture
def proxy(env: S3Server, monkeypatch: pytest.MonkeyPatch):
    p = FaultProxy(env.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    yield p
    p.close()


def _unread(url: str, origins: dict[int, Origin]) -> dict[str, torch.Tensor]:
    return dict(RemoteWeights(url, tp_size=2, origins=origins))


def _watch(origins: dict[int, Origin], params: dict[str, torch.Tensor]) -> CopyWatch:
    return CopyWatch(origins, list(params.items()), tp_size=2, adopt=False, remote=True)


def test_a_rank_fetches_only_the_rows_and_columns_its_weight_loaders_copy(stored, proxy) -> None:
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = _unread(url, origins)
    headers = proxy.sent  # the file's header, read when it was opened
    rows = torch.empty(ROWS // 2, COLS, dtype=torch.bfloat16)  # column-parallel: rank 1's rows
    cols = torch.empty(ROWS, COLS // 2, dtype=torch.bfloat16)  # row-parallel: rank 0's columns
    norm = torch.empty(COLS, dtype=torch.bfloat16)  # held whole by every rank
    with _watch(origins, {"rows": rows, "cols": cols, "norm": norm}):
        rows.copy_(unread["w"].narrow(0, ROWS // 2, ROWS // 2))
        cols.copy_(unread["o"].narrow(1, 0, COLS // 2))
        norm.copy_(unread["norm"])
    assert torch.equal(rows, tensors["w"][ROWS // 2 :])
    assert torch.equal(cols, tensors["o"][:, : COLS // 2])
    assert torch.equal(norm, tensors["norm"])
    # what the store sent: half of each weight, the norm, and one response's HTTP header per
    # ranged GET (one for the rows, one per row for the columns); not the other halves (64 KiB
    # each), nor the unused tensor
    wanted = tensors["w"].nbytes // 2 + tensors["o"].nbytes // 2 + tensors["norm"].nbytes
    fetched = proxy.sent - headers
    assert wanted <= fetched < wanted + (ROWS + 8) * 512, (fetched, wanted)


def test_a_slice_copied_into_another_dtype_is_converted(stored, proxy) -> None:
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = _unread(url, origins)
    dst = torch.empty(ROWS, COLS // 2, dtype=torch.float32)
    ids = torch.empty(ROWS // 2, 4, dtype=torch.int32)
    with _watch(origins, {"dst": dst, "ids": ids}):
        dst.copy_(unread["w"].narrow(1, COLS // 2, COLS // 2))
        ids.copy_(unread["ids"].narrow(0, 0, ROWS // 2))
    assert torch.equal(dst, tensors["w"][:, COLS // 2 :].float())
    assert torch.equal(ids, tensors["ids"][: ROWS // 2].to(torch.int32))


@pytest.mark.parametrize(
    "use",
    [
        lambda t: t.float().sum(),
        lambda t: (t * 2).narrow(0, 0, 3),
        lambda t: t[torch.tensor([0, 5])],  # a tensor index reads elements
        lambda t: t.contiguous().clone(),
        lambda t: torch.cat([t.narrow(0, 0, 2), t.narrow(0, 2, 2)]),
    ],
)
def test_anything_else_that_reads_an_unread_tensor_sees_all_of_it(stored, proxy, use) -> None:
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = _unread(url, origins)
    with _watch(origins, {}):
        got = use(unread["w"])
    assert torch.equal(got, use(tensors["w"]))


def test_a_view_that_reads_nothing_fetches_nothing(stored, proxy) -> None:
    url, _ = stored
    origins: dict[int, Origin] = {}
    unread = _unread(url, origins)
    before = proxy.sent
    with _watch(origins, {}):
        w = unread["w"]
        assert (w.shape, w.dtype, w.dim(), w.numel()) == (
            (ROWS, COLS),
            torch.bfloat16,
            2,
            ROWS * COLS,
        )
        w.narrow(0, 0, 2).t()[1:3]
        w.chunk(2)
    assert proxy.sent == before


def test_an_unread_tensor_leaves_the_origins_when_freed(stored, proxy) -> None:
    # a later allocation at the same address must never be taken for it
    url, _ = stored
    origins: dict[int, Origin] = {}
    unread = _unread(url, origins)
    assert len(origins) == len(unread) == 4
    view = unread["w"].narrow(0, 1, 2)
    unread.clear()
    gc.collect()
    assert [o.name for o in origins.values()] == ["w"]  # the view keeps its memory
    del view
    gc.collect()
    assert origins == {}


def test_one_rank_lets_go_of_each_tensor_once_its_weight_loader_has_it(stored, proxy) -> None:
    # the batch read ahead holds a tensor only until it is handed out, so the memory beside the
    # model shrinks as the weight loaders consume the batch, not only when the batch ends
    url, tensors = stored
    stream = iter(RemoteWeights(url, batch_bytes=1 << 30))  # every tensor in one batch
    name, first = next(stream)
    assert torch.equal(first, tensors[name])
    gone = weakref.ref(first)
    del first
    name, second = next(stream)
    assert gone() is None
    assert torch.equal(second, tensors[name])
    stream.close()  # type: ignore[attr-defined]


def test_a_copy_into_an_unread_tensor_is_not_undone_by_a_later_read(stored, proxy) -> None:
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = _unread(url, origins)
    ones = torch.ones(COLS, dtype=torch.bfloat16)
    with _watch(origins, {}):
        unread["norm"][:4].copy_(ones[:4])
        got = unread["norm"].float()
    want = tensors["norm"].clone()
    want[:4] = 1
    assert torch.equal(got, want.float())


_ONE_RANK = """
import ctypes, sys
from fastload.integrations.vllm.remote import RemoteWeights

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

stream = RemoteWeights(sys.argv[1], batch_bytes=32 << 20)
for name, tensor in stream:
    del tensor  # what a weight loader does once it copied it
after = rss()
ctypes.CDLL(None).malloc_trim(0)
print(after - rss())
"""


def test_one_rank_hands_the_memory_of_its_batches_back_after_the_load(
    env: S3Server, tmp_path: Path
) -> None:
    # 256 MiB read in batches of 32 MiB on the reader thread and freed one tensor at a time:
    # malloc's arenas kept about 80 MiB of them, counted in the server's RSS, until the stream
    # trimmed them. Measured by the OS in a fresh process, as what a trim after the load still
    # gives back: what the load freed and kept (not what is live, which the timing of the
    # reader thread and the HTTP client's buffers move by tens of MiB between runs).
    tensors = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(64)}
    save_file(tensors, tmp_path / "model.safetensors")
    url = env.upload(tmp_path / "model.safetensors", "models", "trim/model.safetensors")
    done = subprocess.run(
        [sys.executable, "-c", _ONE_RANK, url],
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    kept = int(done.stdout.split()[-1])
    assert kept < 8 << 20, kept >> 20


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="torch without float4")
def test_a_packed_tensor_is_handed_out_whole(env: S3Server, tmp_path: Path) -> None:
    # the engine reads no slice of a packed F4 tensor: it comes whole, already read
    packed = torch.arange(64, dtype=torch.uint8).reshape(8, 8).view(torch.float4_e2m1fn_x2)
    save_file({"f": packed}, tmp_path / "model.safetensors")
    url = env.upload(tmp_path / "model.safetensors", "models", "f4/model.safetensors")
    origins: dict[int, Origin] = {}
    got = _unread(url, origins)["f"]
    assert origins == {}
    assert torch.equal(got.view(torch.uint8), packed.view(torch.uint8))


def _gate(proxy: FaultProxy) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Holds every data GET (past the header) until the returned ``open`` event is set (at
    most 60 s); ``held`` is set when one is waiting, ``released`` when one went on."""
    held, opened, released = threading.Event(), threading.Event(), threading.Event()

    def wait(path: str, start: int) -> None:
        if start > 8:  # past the header's two requests (its length at 0, the header at 8)
            held.set()
            opened.wait(60)
            released.set()

    proxy.on_get = wait
    return held, opened, released


def test_one_rank_queues_its_copies_and_nothing_reads_a_parameter_before_its_bytes(
    stored, proxy
) -> None:
    # one rank's weight loaders copy whole tensors; each copy returns at once, fetched behind
    # them straight into the parameter; anything that reads the parameter waits for its bytes
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = dict(RemoteWeights(url, origins=origins, unread=True))
    param = torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
    held, opened, _ = _gate(proxy)
    with _watch(origins, {"param": param}):
        param.copy_(unread["w"])  # returns with its GET held by the proxy
        assert held.wait(60)
        threading.Timer(0.2, opened.set).start()
        total = param.float().sum()  # waits for the fetch, however late it comes
        param[:4].copy_(torch.ones(4, COLS, dtype=torch.bfloat16))  # lands after it
    assert total == tensors["w"].float().sum()
    want = tensors["w"].clone()
    want[:4] = 1
    assert torch.equal(param, want)


def test_a_write_beside_a_queued_fetch_does_not_wait_for_it(stored, proxy) -> None:
    # vLLM's vocabulary weight loader: the checkpoint's rows copied into the top of a padded
    # embedding, then the padding rows below them zeroed, which touches no byte of the fetch
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = dict(RemoteWeights(url, origins=origins, unread=True))
    param = torch.full((ROWS + 4, COLS), 7, dtype=torch.bfloat16)
    held, opened, released = _gate(proxy)
    with _watch(origins, {"param": param}):
        param[:ROWS].data.copy_(unread["w"])  # queued, its GET held by the proxy
        assert held.wait(60)
        param[ROWS:].data.fill_(0)
        assert not released.is_set()  # the zeroing did not wait for the fetch
        threading.Timer(0.2, opened.set).start()
        param[ROWS - 1 :].data.fill_(0)  # one row of the fetch's too: lands after it
    want = torch.cat([tensors["w"][: ROWS - 1], torch.zeros(5, COLS, dtype=torch.bfloat16)])
    assert torch.equal(param, want)


def test_a_load_given_up_cancels_the_fetch_being_made(stored, proxy) -> None:
    # a load given up does not wait for the engine call under way (up to 256 MiB of fetches,
    # from a store that may be slow or stalled) to end
    url, _ = stored
    origins: dict[int, Origin] = {}
    unread = dict(RemoteWeights(url, origins=origins, unread=True))
    param = torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
    held, opened, released = _gate(proxy)
    try:
        with pytest.raises(RuntimeError, match="a weight loader failed"):
            with _watch(origins, {"param": param}):
                param.copy_(unread["w"])  # queued, its GET held by the proxy
                assert held.wait(60)
                raise RuntimeError("a weight loader failed")
        assert not released.is_set()  # the load ended without waiting for the held GET
    finally:
        opened.set()


def test_a_later_copy_into_the_same_bytes_lands_last(stored, proxy) -> None:
    url, tensors = stored
    origins: dict[int, Origin] = {}
    unread = dict(RemoteWeights(url, origins=origins, unread=True))
    param = torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
    with _watch(origins, {"param": param}):
        param.copy_(unread["w"])
        param.narrow(0, 0, ROWS // 2).copy_(unread["o"].narrow(0, 0, ROWS // 2))
        param.copy_(unread["o"])
        param.narrow(0, 0, ROWS // 2).copy_(unread["w"].narrow(0, 0, ROWS // 2))
    want = torch.cat([tensors["w"][: ROWS // 2], tensors["o"][ROWS // 2 :]])
    assert torch.equal(param, want)


def test_a_queued_fetch_that_fails_stops_the_load_naming_the_file_and_the_tensor(
    env: S3Server, stored, proxy, tmp_path: Path
) -> None:
    url, tensors = stored
    origins: dict[int, Origin] = {}
    options = {"max_retries": 1}
    unread = dict(RemoteWeights(url, origins=origins, unread=True, storage_options=options))
    param = torch.zeros(ROWS, COLS, dtype=torch.bfloat16)
    changed = threading.Event()

    def replace(path: str, start: int) -> None:  # a new version at the first data GET
        if start > 8 and not changed.is_set():  # past the header's requests (at 0 and 8)
            changed.set()
            other = {k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(other, tmp_path / "replaced.safetensors")
            env.client().upload_file(
                str(tmp_path / "replaced.safetensors"), "models", "slices/model.safetensors"
            )

    proxy.on_get = replace
    with pytest.raises(FastloadError) as raised:
        with _watch(origins, {"param": param}):
            param.copy_(unread["w"])  # queued: the failure comes at the end of the load
    assert changed.is_set()
    message = str(raised.value)
    assert url in message and "'w'" in message, message


#: rank 0 of N (argv[3]): every tensor handed out unread, its weight loaders copy their 1/N of
#: the rows into CPU parameters
_RANK_ZERO = """
import sys, torch
from fastload.integrations.vllm.adopt import CopyWatch
from fastload.integrations.vllm.remote import RemoteWeights

n = int(sys.argv[3]) if len(sys.argv) > 3 else 2
origins = {}
stream = RemoteWeights(
    sys.argv[1], tp_size=n, origins=origins, progress=sys.argv[2] == "on", unread=True
)
with CopyWatch(origins, [], tp_size=n, adopt=False, remote=True):
    for name, tensor in stream:
        part = tensor.narrow(0, 0, tensor.shape[0] // n)
        torch.empty(part.shape, dtype=part.dtype).copy_(part)  # a parameter of this rank
print(stream.fetches.progress.counter.done)
"""


@pytest.fixture(scope="module")
def large(server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> str:
    """72 MiB in four F32 tensors: above the size that shows a bar when stderr is no terminal."""
    where = tmp_path_factory.mktemp("large") / "model.safetensors"
    save_file({f"t{i}": torch.full((2048, 2304), float(i)) for i in range(4)}, where)
    return server.upload(where, "models", "large/model.safetensors")


def _rank_zero(url: str, progress: str, ranks: int = 2, **env: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _RANK_ZERO, url, progress, str(ranks)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1]), done.stderr


@pytest.fixture
def bars_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in DISABLE_VARS:
        monkeypatch.delenv(var, raising=False)


def test_a_tensor_parallel_rank_draws_the_load_and_says_what_it_fetched(
    env: S3Server, large: str, bars_allowed: None
) -> None:
    fetched, err = _rank_zero(large, "on")
    assert fetched == 36 << 20  # half of each tensor's rows
    # what the user sees last: this rank's share fetched, to its end (not a bar of the
    # checkpoint stopped at half of it, nor one ended before the fetches queued behind the
    # weight loaders landed)
    last = [s for s in err.replace("\r", "\n").splitlines() if s.strip()][-1]
    assert last.startswith("fastload: loading weights (this rank fetches its slices): 100%"), err
    assert "| 36.00/36.00 MiB [" in last, err


def test_one_rank_draws_the_whole_checkpoint_fetched(
    env: S3Server, large: str, bars_allowed: None
) -> None:
    fetched, err = _rank_zero(large, "on", ranks=1)
    assert fetched == 72 << 20
    last = [s for s in err.replace("\r", "\n").splitlines() if s.strip()][-1]
    assert last.startswith("fastload: loading weights: 100%"), err
    assert "| 72.00/72.00 MiB [" in last, err


@pytest.mark.parametrize(
    ("progress", "switch"), [("off", {}), ("on", {"FASTLOAD_DISABLE_PROGRESS_BARS": "1"})]
)
def test_a_tensor_parallel_rank_draws_nothing_when_progress_is_off(
    env: S3Server, large: str, bars_allowed: None, progress: str, switch: dict[str, str]
) -> None:
    fetched, err = _rank_zero(large, progress, **switch)
    assert fetched == 36 << 20 and "fastload" not in err, err
