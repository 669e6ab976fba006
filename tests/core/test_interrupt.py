"""Ctrl-C while a store stalls: the requests in flight are abandoned at once, and the load or the
command stops with ``KeyboardInterrupt`` (the CLI: status 130), not when the timeouts and
retries run out.

The store is a plain HTTP server on 127.0.0.1 (an ``http://`` URL) that serves a safetensors
file with ranges but never answers the request it is told to stall. The client's timeouts are
set to 10 minutes, longer than every bound here: only a cancelled request lets a case finish.
SIGINT is sent once the stalled request has arrived, so no case depends on timing.

Each child sets Python's own SIGINT handler before anything else: a process started with SIGINT
ignored keeps it ignored (a background job of a non-interactive shell, ``nohup``, ``setsid``
started from one), and the suite must pass there too, so the children must not inherit it."""

from __future__ import annotations

import email.utils
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import fastload

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

#: every wait of a case, far below the client's 10-minute timeouts
BOUND = 60
NEVER = ["-o", "read_timeout=600s", "-o", "timeout=600s", "-o", "max_retries=0"]
#: the first line of every child: Ctrl-C raises KeyboardInterrupt, as in a terminal, whatever
#: disposition of SIGINT the test run inherited
AS_AT_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
#: the CLI's entry point (what the ``fastload`` script runs), after that first line
CLI = AS_AT_A_TERMINAL + "import sys; from fastload.tools.cli import main; sys.exit(main())\n"


class StallingStore:
    """Serves ``data`` as ``/m.safetensors``; the first request of kind ``stall`` (``"HEAD"``:
    a HEAD or a listing's PROPFIND, or ``"data"``: a ranged GET past the first bytes) never gets
    an answer, and ``stalled`` is set when it arrives."""

    def __init__(self, data: bytes, stall: str) -> None:
        self.stalled = threading.Event()
        self.release = threading.Event()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _headers(self, status: int, length: int, extra: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(length))
                self.send_header("Last-Modified", email.utils.formatdate(0, usegmt=True))
                self.send_header("ETag", '"v1"')
                self.send_header("Accept-Ranges", "bytes")
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()

            def _stall(self) -> None:
                store.stalled.set()
                store.release.wait(BOUND * 3)

            def do_HEAD(self) -> None:
                if stall == "HEAD":
                    return self._stall()
                self._headers(200, len(data), {})

            def do_PROPFIND(self) -> None:
                if stall == "HEAD":
                    return self._stall()
                self.send_error(501)

            def do_GET(self) -> None:
                start, end = 0, len(data) - 1
                spec = self.headers.get("Range", "")
                if spec.startswith("bytes="):
                    first, _, last = spec[6:].partition("-")
                    start, end = int(first), min(int(last or end), end)
                if stall == "data" and start > 64:
                    return self._stall()
                rng = {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
                self._headers(206 if spec else 200, end - start + 1, rng if spec else {})
                self.wfile.write(data[start : end + 1])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/m.safetensors"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def checkpoint(tmp_path: Path) -> bytes:
    path = tmp_path / "m.safetensors"
    fastload.save_file({"w": torch.arange(64 * 1024, dtype=torch.float32)}, path)
    return path.read_bytes()


def _interrupted(argv: list[str], store: StallingStore) -> subprocess.CompletedProcess[str]:
    """Runs ``argv`` in a fresh interpreter, sends it SIGINT once the stalled request arrived,
    and returns how it ended (it is killed, and the case fails, if it does not end in time)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    child = subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert store.stalled.wait(BOUND), "the stalled request never arrived"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=BOUND)
    except BaseException:
        child.kill()
        child.communicate()
        raise
    finally:
        store.close()
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


@pytest.mark.parametrize("stall", ["HEAD", "data"])
def test_ctrl_c_stops_load_file_while_the_store_stalls(checkpoint, stall):
    store = StallingStore(checkpoint, stall)
    script = AS_AT_A_TERMINAL + (
        "import sys, fastload\n"
        "try:\n"
        "    fastload.load_file(sys.argv[1], storage_options={'read_timeout': '600s',\n"
        "                       'timeout': '600s', 'max_retries': '0'})\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    done = _interrupted(["-c", script, store.url], store)
    assert done.returncode == 0 and done.stdout.strip() == "interrupted", done.stderr


@pytest.mark.parametrize(
    ("command", "stall"), [("inspect", "HEAD"), ("verify", "data"), ("fetch", "HEAD")]
)
def test_ctrl_c_stops_the_cli_while_the_store_stalls(checkpoint, command, stall, tmp_path):
    store = StallingStore(checkpoint, stall)
    url = store.url.rsplit("/", 1)[0] + "/" if command == "fetch" else store.url
    extra = [str(tmp_path / "out")] if command == "fetch" else []
    done = _interrupted(["-c", CLI, command, url, *extra, *NEVER], store)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "fastload: error: interrupted"
