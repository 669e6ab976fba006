"""A real S3-compatible server on 127.0.0.1 for the object storage tests, and a proxy that cuts or
stalls its connections.

The server is ``s3s-fs`` (the file-system backend of the ``s3s`` crate, installed from crates.io
by ``scripts/s3-server.sh``): objects are files, a ranged GET reads just its range, and requests
are checked against their SigV4 signature. moto's server was the other candidate; it reads an
object whole for every ranged GET (8 MiB ranges of a 256 MiB object ran at 24 MB/s there, 280 MB/s
from s3s-fs) and accepts any credentials, so neither the benchmark nor the "denied" fault would
mean anything against it.

The binary is ``$FASTLOAD_S3_SERVER``, else ``~/.cache/fastload/s3s-fs/bin/s3s-fs``, else
``s3s-fs`` on ``PATH``. Without one the tests that need it are skipped, unless
``FASTLOAD_REQUIRE_S3_SERVER=1`` (set by ``.ci/run``), which makes them fail instead.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "fastload-test-key"
SECRET_KEY = "fastload-test-secret"
REGION = "us-east-1"
#: no retries (a retried range would be counted twice at a proxy), no time limit a busy machine
#: can reach
PATIENT = {"max_retries": "0", "connect_timeout": "60s", "timeout": "600s"}


def patient_options(endpoint: str, secret: str = SECRET_KEY) -> dict[str, str]:
    """``storage_options`` reaching the test server (or a proxy) at ``endpoint``, with
    :data:`PATIENT`'s settings (``secret``: a wrong one, to be denied)."""
    return {
        "aws_endpoint": endpoint,
        "aws_region": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": secret,
        **PATIENT,
    }


def server_binary() -> str | None:
    """The s3s-fs binary, or None."""
    given = os.environ.get("FASTLOAD_S3_SERVER")
    if given:
        return given
    cached = Path.home() / ".cache" / "fastload" / "s3s-fs" / "bin" / "s3s-fs"
    if cached.is_file():
        return str(cached)
    return shutil.which("s3s-fs")


def require_server() -> str:
    """The binary, or a skip (a failure under ``FASTLOAD_REQUIRE_S3_SERVER=1``)."""
    binary = server_binary()
    if binary is None:
        why = "no s3s-fs binary (install it with: bash scripts/s3-server.sh)"
        if os.environ.get("FASTLOAD_REQUIRE_S3_SERVER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"s3s-fs exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"s3s-fs did not listen on port {port} within {timeout} s")


class S3Server:
    """s3s-fs serving a fresh directory on 127.0.0.1, with a boto3 client for uploads."""

    def __init__(self, root: Path, *, anonymous: bool = False) -> None:
        """``anonymous``: no credentials asked (a plain HTTP server of the same objects, for
        ``http://`` URLs)."""
        binary = require_server()
        self.root = root
        self.port = _free_port()
        keys = [] if anonymous else ["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY]
        self.process = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(self.port), *keys, str(root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for_port(self.port, self.process)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The AWS variables a user sets to reach this server (or ``endpoint``, a proxy)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(retries={"max_attempts": 2}),
        )

    def bucket(self, name: str) -> str:
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.ClientError as e:  # s3s-fs answers an existing bucket this way
            if "BucketAlreadyExists" not in str(e):
                raise
        return name

    def upload(self, local: Path, bucket: str, key: str) -> str:
        """Uploads a file, or every file of a directory under the prefix ``key``; returns the
        ``s3://`` URL."""
        client = self.client()
        if local.is_dir():
            for f in sorted(local.rglob("*")):
                if f.is_file():
                    client.upload_file(str(f), bucket, f"{key}/{f.relative_to(local).as_posix()}")
            return f"s3://{bucket}/{key}/"
        client.upload_file(str(local), bucket, key)
        return f"s3://{bucket}/{key}"

    def place(self, local: Path, bucket: str, key: str) -> str:
        """As :meth:`upload` for a directory, without a client: s3s-fs serves the files of its
        root directory (``root/bucket/key``), so copying them there is uploading them (for
        environments without boto3, such as vLLM's). Each file's ETag (its MD5) is written where
        s3s-fs keeps an uploaded object's (:meth:`tag`): without it, s3s-fs hashes the whole file
        on every request for it."""
        target = self.root / bucket / key
        shutil.copytree(local, target, dirs_exist_ok=True)
        for f in sorted(target.rglob("*")):
            if f.is_file():
                self.tag(bucket, f"{key}/{f.relative_to(target).as_posix()}")
        return f"s3://{bucket}/{key}/"

    def tag(self, bucket: str, key: str) -> None:
        """Records the ETag (MD5) of the file served as ``bucket/key`` as s3s-fs records an
        uploaded object's (``.bucket-<b64>.object-<b64>.internal.json`` in its root); call it
        again after changing the file, or the server answers with the old ETag."""
        digest = hashlib.md5()
        with open(self.root / bucket / key, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)

        def b64(text: str) -> str:
            return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

        info = self.root / f".bucket-{b64(bucket)}.object-{b64(key)}.internal.json"
        try:
            info.write_text(json.dumps({"e_tag": digest.hexdigest()}))
        except OSError as e:  # a key too long for the record's name: s3s-fs hashes the file
            if e.errno != errno.ENAMETOOLONG:
                raise

    def rewrite(self, bucket: str, key: str, data: bytes) -> None:
        """Replaces the object ``bucket/key`` with ``data`` as a store does (whole, at once: a
        request sees the old bytes or the new ones, never a file cut short while it is
        rewritten), then records its new ETag (:meth:`tag`)."""
        path = self.root / bucket / key
        fresh = path.with_name(f".{path.name}.rewrite")
        fresh.write_bytes(data)
        os.replace(fresh, path)
        self.tag(bucket, key)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``port`` that, when armed, cuts (``"cut"``: closes
    both sides at once) or stalls (``"stall"``: stops forwarding for ``stall_seconds``, then
    closes) the next ``times`` connections once ``after`` bytes of responses went through each
    (``times=-1``: every connection). ``sent`` counts the response bytes it forwarded,
    ``sent_to`` the same per client process (found from outside: the process holding the
    client's end of the connection, :func:`client_pid`), ``requests`` each request's ``(method,
    path, first byte, last byte or None)`` as it was asked (no ``Range``: ``(0, None)``), and
    ``faults`` the faults it made."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.lock = threading.Lock()
        self.mode = "pass"
        self.after = 0
        self.times = 0
        self.stall_seconds = 0.0
        self.sent = 0
        self.sent_to: dict[int | None, int] = {}
        self.requests: list[tuple[str, str, int, int | None]] = []
        self.faults = 0
        self.closed = False
        self._hold: tuple[str, str, float] | None = None
        self._second = threading.Event()
        #: with hold(): whether a data request for the second key came while the first's waited
        self.overlapped: bool | None = None
        #: called with (path, first byte asked) before each GET is forwarded (to change the
        #: store's files at a given point of a load)
        self.on_get: Callable[[str, int], None] | None = None
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, mode: str, *, after: int, times: int = 1, stall_seconds: float = 0) -> None:
        with self.lock:
            self.mode, self.after, self.times = mode, after, times
            self.stall_seconds = stall_seconds

    def disarm(self) -> None:
        self.arm("pass", after=0, times=0)

    def hold(self, first: str, second: str, timeout: float = 20) -> None:
        """Holds the first data request (a ranged GET past the header's two requests, which
        start at bytes 0 and 8) for a key containing ``first`` until one for a key containing
        ``second`` arrives, at most ``timeout`` seconds; ``overlapped`` then says whether it
        did. A client reading the two one after the other cannot make it True."""
        self._hold, self.overlapped = (first, second, timeout), None
        self._second.clear()

    def _request(self, data: bytes) -> None:
        method = data.split(b" ", 1)[0]
        if method not in (b"GET", b"HEAD", b"PUT", b"POST", b"DELETE"):
            return  # the rest of a request's body, not a request
        path = data.split(b" ", 2)[1].decode("latin-1")
        lower = data.lower()
        at = lower.find(b"range: bytes=")
        low, _, high = lower[at + 13 :].split(b"\r\n", 1)[0].partition(b"-")
        start = int(low) if at >= 0 else 0
        end = int(high) if at >= 0 and high.strip() else None
        with self.lock:
            self.requests.append((method.decode("latin-1"), path, start, end))
        if method != b"GET":
            return
        if self.on_get is not None:
            self.on_get(path, start)
        if self._hold is None:
            return
        first, second, timeout = self._hold
        if start <= 8:  # the header's length (at 0) or the header (at 8)
            return
        if second in path:
            self._second.set()
        elif first in path and self.overlapped is None:
            self.overlapped = False
            self.overlapped = self._second.wait(timeout)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, peer = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            pid = client_pid(peer[1], self.port)
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, pid), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                self._request(data)
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _fault_now(self, forwarded: int) -> str | None:
        with self.lock:
            if self.mode == "pass" or self.times == 0 or forwarded < self.after:
                return None
            if self.times > 0:
                self.times -= 1
            self.faults += 1
            return self.mode

    def _down(self, upstream: socket.socket, client: socket.socket, pid: int | None) -> None:
        forwarded = 0
        try:
            while data := upstream.recv(1 << 16):
                fault = self._fault_now(forwarded + len(data))
                if fault is not None:
                    keep = max(0, self.after - forwarded)
                    client.sendall(data[:keep])
                    if fault == "stall":
                        time.sleep(self.stall_seconds)
                    return
                # counted before it goes: a client that has the bytes finds them counted
                with self.lock:
                    self.sent += len(data)
                    self.sent_to[pid] = self.sent_to.get(pid, 0) + len(data)
                client.sendall(data)
                forwarded += len(data)
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)

    def close(self) -> None:
        self.closed = True
        _close(self.listener)


@contextmanager
def counting_proxies(port: int, count: int) -> Iterator[list[FaultProxy]]:
    """``count`` unarmed :class:`FaultProxy` in front of ``port`` (one per rank: what each rank
    fetched is counted apart), closed on the way out."""
    proxies = [FaultProxy(port) for _ in range(count)]
    try:
        yield proxies
    finally:
        for proxy in proxies:
            proxy.close()


def client_pid(port: int, server_port: int) -> int | None:
    """The process holding the client end (127.0.0.1:``port``) of a TCP connection to
    127.0.0.1:``server_port`` (Linux: the socket's inode in /proc/net/tcp, then the process with a
    descriptor on it); ``None`` where it cannot be found (gone already, another user's)."""
    local, remote = f"0100007F:{port:04X}", f"0100007F:{server_port:04X}"
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[2] == remote:
                inode = fields[9]
                break
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) == target:
                    return int(entry.name)
        except OSError:  # gone, or not ours to read
            continue
    return None


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
