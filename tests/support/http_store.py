"""A plain HTTP server on 127.0.0.1 serving local files as an object store (``http://`` URLs):
HEAD and ranged GETs with validators (ETag, Last-Modified), no listing (``PROPFIND`` is refused,
as plain web servers do). It ignores the user-info and the query of the URLs it is asked for, so a
test can read through ``http://user:PASSWORD@host/...?sig=...`` and check what fastload shows.

``stall(path)`` makes the ranged GETs of that file's tensor data (past its header) wait, unanswered,
until the server is closed; ``stalled`` is set when the first one arrives, the point at which a
test interrupts the reader."""

from __future__ import annotations

import email.utils
import struct
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: the longest a stalled request waits for the server to close
STALL_BOUND = 180


class HttpStore:
    """Serves every file under ``root`` at ``http://127.0.0.1:PORT/<relative path>``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stalled = threading.Event()
        self._release = threading.Event()
        self._stall: set[str] = set()
        store = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _file(self) -> Path | None:
                rel = urllib.parse.urlsplit(self.path).path.lstrip("/")
                path = store.root / urllib.parse.unquote(rel)
                return path if rel and path.is_file() else None

            def _headers(self, status: int, length: int, extra: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(length))
                self.send_header("Last-Modified", email.utils.formatdate(0, usegmt=True))
                self.send_header("ETag", '"v1"')
                self.send_header("Accept-Ranges", "bytes")
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self) -> None:
                path = self._file()
                if path is None:
                    return self.send_error(404)
                self._headers(200, path.stat().st_size, {})

            def do_PROPFIND(self) -> None:
                self.send_error(501)

            def do_GET(self) -> None:
                path = self._file()
                if path is None:
                    return self.send_error(404)
                data = path.read_bytes()
                start, end = 0, len(data) - 1
                spec = self.headers.get("Range", "")
                if spec.startswith("bytes="):
                    first, _, last = spec[6:].partition("-")
                    start, end = int(first), min(int(last or end), end)
                header_end = 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
                if path.relative_to(store.root).as_posix() in store._stall and start >= header_end:
                    store.stalled.set()
                    store._release.wait(STALL_BOUND)
                    return
                rng = {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
                self._headers(206 if spec else 200, end - start + 1, rng if spec else {})
                self.wfile.write(data[start : end + 1])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str = "", *, user_info: str = "", query: str = "") -> str:
        """The URL of ``path`` under the root, with ``user_info`` (``user:PASSWORD``) and
        ``query`` (``sig=...``) written into it as a user would."""
        at = f"{user_info}@" if user_info else ""
        port = self.server.server_address[1]
        return f"http://{at}127.0.0.1:{port}/{path}" + (f"?{query}" if query else "")

    def stall(self, path: str) -> None:
        """The tensor data of ``path`` (relative to the root) is never served from now on."""
        self._stall.add(path)

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
