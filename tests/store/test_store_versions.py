"""Plain HTTP stores: an object replaced during a load, on stores that send no ETag, is never a
mix of two versions; ``fastload verify`` reads a checkpoint of many tensors in a few requests.
The store is a plain HTTP server on 127.0.0.1 (an ``http://`` URL) that serves ranges, ignores
conditional headers (as some do), counts its GETs, and can replace the object, same size, after
its first data request."""

from __future__ import annotations

import email.utils
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import fastload
from fastload.core.basics.errors import CheckpointError, RequestError

#: two tensors of 6 MiB: the load reads them with several ranged GETs
SHAPE = (1536, 1024)


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the load's parallel requests (5 by default: connections reset)
    daemon_threads = True


class VersionedStore:
    """Serves ``versions[0]`` as ``/m.safetensors`` with the validators asked for
    (``etag``, ``dated``); with ``replace``, serves ``versions[1]`` (dated a day later) from the
    second data request on. ``data_requests`` counts the ranged GETs past the header."""

    def __init__(self, versions: list[bytes], *, etag: bool, dated: bool, replace: bool) -> None:
        self.data_requests = 0
        self.gets = 0
        lock = threading.Lock()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _version(self, data_request: bool) -> int:
                with lock:
                    if data_request:
                        store.data_requests += 1
                    return 1 if replace and store.data_requests > 1 else 0

            def _send(self, status: int, which: int, length: int, extra: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(length))
                if dated:
                    stamp = email.utils.formatdate(86400 * (1 + which), usegmt=True)
                    self.send_header("Last-Modified", stamp)
                if etag:
                    self.send_header("ETag", f'"v{which}"')
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self) -> None:
                self._send(200, self._version(False), len(versions[0]), {})

            def do_GET(self) -> None:
                with lock:
                    store.gets += 1
                size = len(versions[0])
                spec = self.headers.get("Range", "bytes=0-").removeprefix("bytes=")
                first, _, last = spec.partition("-")
                start, end = int(first), min(int(last or size - 1), size - 1)
                which = self._version(start > 4096)
                content_range = {"Content-Range": f"bytes {start}-{end}/{size}"}
                self._send(206, which, end - start + 1, content_range)
                self.wfile.write(versions[which][start : end + 1])

        self.server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/m.safetensors"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def versions(tmp_path: Path) -> list[bytes]:
    out = []
    for i, fill in enumerate((0.0, 1.0)):
        path = tmp_path / f"v{i}.safetensors"
        tensors = {"a": torch.full(SHAPE, fill), "b": torch.full(SHAPE, fill)}
        fastload.save_file(tensors, path)
        out.append(path.read_bytes())
    assert len(out[0]) == len(out[1])
    return out


def _store(versions: list[bytes], **kwargs: bool):
    store = VersionedStore(versions, **kwargs)
    return store


def test_a_same_size_replacement_without_etag_is_refused_by_its_date(versions):
    store = _store(versions, etag=False, dated=True, replace=True)
    try:
        with pytest.raises(CheckpointError, match=r"\[object-changed\].*replaced while loading"):
            fastload.load_file(store.url, threads=4)
    finally:
        store.close()
    assert store.data_requests > 1  # the replacement did happen during the load


def test_an_object_with_only_a_date_loads_whole(versions):
    store = _store(versions, etag=False, dated=True, replace=False)
    try:
        got = fastload.load_file(store.url, threads=4)
    finally:
        store.close()
    assert all(torch.equal(t, torch.zeros(SHAPE)) for t in got.values())


def test_an_object_with_no_validator_is_refused_saying_why(versions):
    store = _store(versions, etag=False, dated=False, replace=False)
    try:
        with pytest.raises(RequestError, match=r"neither an ETag nor a Last-Modified"):
            fastload.load_file(store.url)
    finally:
        store.close()


def test_verify_reads_many_small_tensors_in_a_few_requests(tmp_path, capsys):
    from fastload.tools.cli import main

    path = tmp_path / "many.safetensors"
    fastload.save_file({f"t{i:04d}": torch.full((16,), float(i)) for i in range(2000)}, path)
    store = _store([path.read_bytes()], etag=True, dated=True, replace=False)
    try:
        assert main(["verify", store.url]) == 0
    finally:
        store.close()
    assert "2000 tensors" in capsys.readouterr().out
    # the header (one or two requests), then the data: 128 KiB in one buffer, not 2,000 GETs
    assert store.gets <= 10, store.gets
