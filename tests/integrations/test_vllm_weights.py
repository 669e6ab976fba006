"""The vLLM load format's weight stream and copy watch, without vLLM: what a vLLM weight loader
does with the tensors fastload hands out (copy them whole into a parameter, into the rows of a
fused parameter, or narrowed as a tensor-parallel rank does), checked against plain torch copies.
These parts import torch and fastload only, so they run in every environment; the same paths
under a real vLLM engine: tests/integrations/test_vllm.py."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch

from fastload import FastloadError, ModelMismatchError
from fastload.integrations.vllm.adopt import ENGINE_MIN, CopyWatch, _selection
from fastload.integrations.vllm.options import VllmLoadOptions
from fastload.integrations.vllm.weights import CheckpointWeights
from fastload.safetensors.saving import save_file


@pytest.mark.parametrize(
    ("view", "expected"),
    [
        (lambda t: t, None),
        (lambda t: t.narrow(0, 2, 3), [0, 2, 5]),
        (lambda t: t.narrow(1, 4, 4), [1, 4, 8]),
        (lambda t: t[1:, 2:], False),  # two dimensions sliced
        (lambda t: t.t(), False),  # a transpose
        (lambda t: t.narrow(0, 0, 1)[0], False),  # fewer dimensions
    ],
)
def test_a_view_of_a_stored_tensor_becomes_the_engines_selection(view, expected) -> None:
    stored = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    src = view(stored)
    assert _selection(src, tuple(stored.shape), stored.data_ptr()) == expected


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    rows = ENGINE_MIN // (4 * 256) * 2  # each tensor above the engine's threshold
    tensors = {
        "q": torch.randn(rows, 256),
        "k": torch.randn(rows // 2, 256),
        "norm": torch.randn(256),
        "o": torch.randn(256, rows),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path, tensors


def _load(path: Path, tp_size: int) -> tuple[dict[str, torch.Tensor], CopyWatch]:
    """What a vLLM model's ``load_weights`` does on one rank of ``tp_size`` (rank 0): q and k
    into one fused qkv parameter (the rows of this rank), o narrowed along its input dimension,
    the norm whole."""
    origins: dict[int, object] = {}
    stream = CheckpointWeights([str(path)], VllmLoadOptions(), tp_size=tp_size, origins=origins)
    shapes = {f[0]: f[2] for f in stream._files[0].entries or ()}
    rows_q, rows_k = shapes["q"][0] // tp_size, shapes["k"][0] // tp_size
    cols_o = shapes["o"][1] // tp_size
    params = {
        "qkv": torch.nn.Parameter(torch.empty(rows_q + rows_k, 256), requires_grad=False),
        "norm": torch.nn.Parameter(torch.empty(256), requires_grad=False),
        "o": torch.nn.Parameter(torch.empty(256, cols_o), requires_grad=False),
    }
    watch = CopyWatch(origins, params.items(), tp_size=tp_size, adopt=True)  # type: ignore[arg-type]
    with watch:
        for name, tensor in stream:
            if name == "q":
                params["qkv"].data.narrow(0, 0, rows_q).copy_(tensor.narrow(0, 0, rows_q))
            elif name == "k":
                params["qkv"].data.narrow(0, rows_q, rows_k).copy_(tensor.narrow(0, 0, rows_k))
            elif name == "o":
                params["o"].data.copy_(tensor.narrow(1, 0, cols_o))
            else:
                params["norm"].data.copy_(tensor)
    stream.close()
    return params, watch


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weight_loader_copies_give_the_stored_values(tmp_path: Path, tp_size: int) -> None:
    path, tensors = _checkpoint(tmp_path)
    params, watch = _load(path, tp_size)
    rows_q, rows_k = tensors["q"].shape[0] // tp_size, tensors["k"].shape[0] // tp_size
    expected_qkv = torch.cat([tensors["q"][:rows_q], tensors["k"][:rows_k]])
    assert torch.equal(params["qkv"], expected_qkv)
    assert torch.equal(params["o"], tensors["o"][:, : tensors["o"].shape[1] // tp_size])
    assert torch.equal(params["norm"], tensors["norm"])
    if tp_size == 1:
        # the norm and o, parameters kept exactly as stored, became views of the file; the rows
        # of the fused parameter were copied by the engine, not by torch
        assert watch.adopted == 2
        assert watch.engine_bytes == expected_qkv.nbytes
    else:
        # the norm alone is kept whole; a rank's slices are read alone, then copied by torch
        # (see CopyWatch's docstring)
        assert watch.adopted == 1
        assert watch.engine_bytes == 0 and watch.slices_read >= 3


def test_a_copy_of_another_shape_names_the_file_and_the_tensor(tmp_path: Path) -> None:
    path, tensors = _checkpoint(tmp_path)
    origins: dict[int, object] = {}
    stream = CheckpointWeights([str(path)], VllmLoadOptions(), origins=origins)
    wrong = torch.empty(3, 256)
    with (
        pytest.raises(ModelMismatchError, match=rf"{path}: tensor 'k'.*\[shape-mismatch\]"),
        CopyWatch(origins, [], tp_size=1, adopt=True),  # type: ignore[arg-type]
    ):
        for name, tensor in stream:
            if name == "k":
                wrong.copy_(tensor)
    stream.close()


class _Gate:
    """Holds the deferred copies' engine calls until :meth:`open`; counts those that ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from fastload.integrations.vllm import remote_fetches

        self.opened = threading.Event()
        self.done = 0
        real = remote_fetches.fill_many

        def held(*args: object, **kwargs: object) -> object:
            self.opened.wait(timeout=60)
            out = real(*args, **kwargs)
            self.done += 1
            return out

        monkeypatch.setattr(remote_fetches, "fill_many", held)

    def open_later(self, seconds: float) -> None:
        threading.Timer(seconds, self.opened.set).start()


class _Deferred:
    """One rank's load with the engine's copies deferred (``CopyWatch(defer=True)``) into a
    fused qkv parameter of zeros, their engine calls held by a :class:`_Gate`; the stream ends
    only once they are made where ``stream_waits``."""

    def __init__(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, stream_waits: bool = False
    ) -> None:
        self.path, self.tensors = _checkpoint(tmp_path)
        self.gate = _Gate(monkeypatch)
        origins: dict[int, object] = {}
        rows = self.tensors["q"].shape[0] + self.tensors["k"].shape[0]
        self.qkv = torch.nn.Parameter(torch.zeros(rows, 256), requires_grad=False)
        self.watch = CopyWatch(
            origins,  # type: ignore[arg-type]
            [("qkv", self.qkv)],
            tp_size=1,
            adopt=True,
            defer=True,
        )
        deferred = self.watch.deferred if stream_waits else None
        self.stream = CheckpointWeights(
            [str(self.path)], VllmLoadOptions(), origins=origins, deferred=deferred
        )


def test_deferred_engine_copies_land_before_anything_reads_their_parameter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = _Deferred(tmp_path, monkeypatch)
    tensors, qkv = load.tensors, load.qkv
    rows_q = tensors["q"].shape[0]
    with load.watch:
        for name, tensor in load.stream:
            if name in ("q", "k"):
                rows = qkv.data.narrow(0, 0 if name == "q" else rows_q, tensor.shape[0])
                rows.copy_(tensor)
        assert load.gate.done == 0  # both copies returned while their engine calls were held
        load.gate.open_later(0.2)
        total = qkv.sum()  # waits for them
    assert load.watch.engine_bytes == qkv.nbytes
    assert torch.equal(total, torch.cat([tensors["q"], tensors["k"]]).sum())
    assert torch.equal(qkv, torch.cat([tensors["q"], tensors["k"]]))


def test_the_stream_ends_once_the_copies_queued_behind_it_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = _Deferred(tmp_path, monkeypatch, stream_waits=True)
    q = load.tensors["q"]
    with load.watch:
        handed = iter(load.stream)
        load.qkv.data.narrow(0, 0, q.shape[0]).copy_(next(t for n, t in handed if n == "q"))
        load.gate.open_later(0.2)
        list(handed)  # vLLM times its load_weights to here
        assert load.gate.done >= 1
    assert torch.equal(load.qkv[: q.shape[0]], q)


def test_a_later_copy_into_bytes_a_deferred_copy_fills_lands_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = _Deferred(tmp_path, monkeypatch)
    tensors, qkv = load.tensors, load.qkv
    rows_k = tensors["k"].shape[0]
    with load.watch:
        handed = dict(load.stream)
        qkv.data.narrow(0, 0, rows_k).copy_(handed["q"].narrow(0, 0, rows_k))  # queued
        load.gate.open_later(0.2)
        # torch's own copies (too small for the engine; another dtype) into some of those rows
        qkv.data.narrow(0, 0, 2).copy_(handed["k"].narrow(0, 0, 2))
        qkv.data.narrow(0, 2, 2).copy_(handed["k"].narrow(0, 2, 2).double())
    assert torch.equal(qkv[:4], tensors["k"][:4])
    assert torch.equal(qkv[4:rows_k], tensors["q"][4:rows_k])


def test_a_deferred_copy_that_fails_stops_the_load_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = _Deferred(tmp_path, monkeypatch)
    with pytest.raises(FastloadError) as raised, load.watch:
        handed = dict(load.stream)
        load.qkv.data.narrow(0, 0, load.tensors["q"].shape[0]).copy_(handed["q"])  # queued, held
        os.truncate(load.path, 1024)  # the checkpoint cut short before the copy is made
        load.gate.opened.set()
    message = str(raised.value)  # the file's fault, found before any of its tensors is read
    assert str(load.path) in message and "[file-shrunk]" in message, message


def test_a_queue_of_copies_waits_to_stay_within_its_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload import _core
    from fastload.integrations.vllm.remote_fetches import Fetches

    path, tensors = _checkpoint(tmp_path)
    gate = _Gate(monkeypatch)
    file = _core.SafetensorsFile(str(path), "pread")
    q, k = torch.empty_like(tensors["q"]), torch.empty_like(tensors["k"])
    queue = Fetches(ahead=q.nbytes + k.nbytes // 2)  # room for q, not for q and k
    queue.submit(file, "q", q, None)  # one always may, however large
    second = threading.Thread(target=queue.submit, args=(file, "k", k, None))
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive()  # waits: q is not made yet (its engine call is held)
    gate.opened.set()
    second.join(timeout=60)
    assert not second.is_alive()
    queue.drain()
    assert torch.equal(q, tensors["q"]) and torch.equal(k, tensors["k"])


def test_once_the_load_waits_for_its_queue_the_rest_is_made_at_once_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # takes of TAKE_BYTES while the weight loaders queue; once the load waits for the queue
    # (its end, or a read of a parameter not yet fetched), one engine call makes all the rest,
    # started beside the call under way instead of after it
    from fastload import _core
    from fastload.integrations.vllm import remote_fetches

    path, tensors = _checkpoint(tmp_path)
    file = _core.SafetensorsFile(str(path), "pread")
    queue = remote_fetches.Fetches(take_bytes=1)  # while queueing: one fetch per call
    queue.workers = 1
    calls: list[list[str]] = []
    started, beside = threading.Event(), threading.Event()
    real = remote_fetches.fill_many

    def spy(work: list, *args: object, **kwargs: object) -> object:
        calls.append([name for _, items in work for name, _, _ in items])
        if len(calls) == 1:  # the first call ends only once the next one has started
            started.set()
            if beside.wait(30):
                return real(work, *args, **kwargs)
            raise AssertionError("the rest of the queue waited for the call under way")
        beside.set()
        return real(work, *args, **kwargs)

    monkeypatch.setattr(remote_fetches, "fill_many", spy)
    out = {name: torch.empty_like(t) for name, t in tensors.items()}
    queue.submit(file, "q", out["q"], None)
    assert started.wait(60)
    for name in ("k", "norm", "o"):
        queue.submit(file, name, out[name], None)
    queue.drain()
    assert calls == [["q"], ["k", "norm", "o"]]
    assert all(torch.equal(out[name], t) for name, t in tensors.items())


def _present_pages(address: int, nbytes: int) -> int:
    """How many pages of ``[address, address + nbytes)`` this process has mapped (pagemap)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return sum(1 for i in range(0, len(raw), 8) if raw[i + 7] & 0x80)


def test_an_adopted_parameter_replaced_later_leaves_the_page_tables(tmp_path: Path) -> None:
    # vLLM's post-load processing replaces parameters (on CPU: every linear weight, repacked);
    # the checkpoint pages of the one replaced must not stay counted in the server's RSS
    path, tensors = _checkpoint(tmp_path)
    params, watch = _load(path, tp_size=1)
    o = params["o"]
    assert watch.adopted == 2 and torch.equal(o, tensors["o"])  # read: its pages are mapped
    address, nbytes = o.data_ptr(), o.numel() * o.element_size()
    assert _present_pages(address, nbytes) >= nbytes // os.sysconf("SC_PAGE_SIZE") - 1
    o.data = torch.zeros_like(o.data)  # what post-processing does: a new tensor in its place
    gc.collect()
    assert _present_pages(address, nbytes) <= 2  # at most the pages shared with neighbours
    assert torch.equal(params["norm"], tensors["norm"])  # the other views are untouched


def test_the_weights_option_takes_an_object_storage_url_and_its_storage_options() -> None:
    from fastload import RequestError
    from fastload.integrations.vllm.options import parse_options

    url = "s3://bucket/llama/"
    options = parse_options({"weights": url, "storage_options": {"max_retries": 3}})
    assert options.weights == url and options.storage_options == {"max_retries": "3"}
    assert parse_options({}).weights is None
    for bad, words in (
        ({"weights": "/local/dir"}, "must be an object storage URL"),
        ({"weights": 3}, "must be an object storage URL"),
        ({"storage_options": {"region": "x"}}, "'weights', which is not set"),
        ({"weights": url, "storage_options": "region=x"}, "storage_options must be a dict"),
    ):
        with pytest.raises(RequestError, match=words):
            parse_options(bad)


# --- weights staged into the model's device memory (the same code with CPU destinations) -------


def _live_stage_threads() -> int:
    return sum(
        Path(f"/proc/self/task/{t}/comm")
        .read_text()
        .startswith(("fastload-stage", "fastload-vllm-s"))
        for t in os.listdir("/proc/self/task")
        if Path(f"/proc/self/task/{t}/comm").exists()
    )


def test_staged_weights_are_device_tensors_of_their_own_with_the_stored_values(
    tmp_path: Path,
) -> None:
    path, tensors = _checkpoint(tmp_path)
    origins: dict[int, object] = {}
    options = VllmLoadOptions(staged=True, window=64 << 10)  # batches far smaller than the file
    stream = CheckpointWeights([str(path)], options, origins=origins, device=torch.device("cpu"))
    assert stream.staged and not stream.mappings
    seen = {}
    for name, tensor in stream:
        seen[name] = tensor
    stream.close()
    assert set(seen) == set(tensors)
    for name, value in tensors.items():
        assert torch.equal(seen[name], value), name
    # no two handed-out tensors share memory: a weight loader that keeps one keeps it alone
    starts = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in seen.values())
    assert all(a_end <= b for (_, a_end), (b, _) in zip(starts, starts[1:], strict=False))
    assert _live_stage_threads() == 0


def test_staged_batches_stay_within_half_the_window() -> None:
    from fastload.integrations.vllm.staged import batches

    entries = [(f"t{i}", "F32", [n // 4], 0, n) for i, n in enumerate([10, 30, 25, 70, 5, 5])]
    cut = batches(entries, 50)
    assert [[e[0] for e in b] for b in cut] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert all(sum(e[4] - e[3] for e in b) <= 50 or len(b) == 1 for b in cut)


def test_auto_stages_only_an_accelerators_weights_on_one_rank(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path)
    auto = VllmLoadOptions()
    assert not CheckpointWeights([str(path)], auto, device=torch.device("cpu")).staged
    assert CheckpointWeights([str(path)], auto, device=torch.device("meta"), tp_size=1).staged
    assert not CheckpointWeights([str(path)], auto, device=torch.device("meta"), tp_size=2).staged
    off = VllmLoadOptions(staged=False)
    assert not CheckpointWeights([str(path)], off, device=torch.device("meta")).staged


def test_a_staged_stream_dropped_early_stops_its_helpers(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path)
    stream = CheckpointWeights(
        [str(path)], VllmLoadOptions(staged=True, window=64 << 10), device=torch.device("cpu")
    )
    it = iter(stream)
    next(it)
    it.close()  # what a failing load_weights does to the generator
    stream.close()
    assert _live_stage_threads() == 0


def test_a_staged_file_truncated_during_the_load_names_the_file_and_the_tensor(
    tmp_path: Path,
) -> None:
    from fastload import CheckpointError

    path, _ = _checkpoint(tmp_path)
    stream = CheckpointWeights(
        [str(path)], VllmLoadOptions(staged=True, window=64 << 10), device=torch.device("cpu")
    )
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=rf"{path}: \[file-shrunk\] tensors? '\w+'"):
        for _ in stream:
            pass
    stream.close()


def test_the_staged_and_window_options_are_checked_where_they_enter() -> None:
    from fastload import RequestError
    from fastload.integrations.vllm.options import parse_options

    assert parse_options({}).staged == "auto" and parse_options({}).window == 1 << 30
    options = parse_options({"staged": True, "window": "256MiB"})
    assert options.staged is True and options.window == 256 << 20
    for bad, words in (
        ({"staged": "yes"}, "'staged' must be 'auto', true or false"),
        ({"window": 0}, "window"),
        ({"window": "lots"}, "window"),
    ):
        with pytest.raises(RequestError, match=words):
            parse_options(bad)
