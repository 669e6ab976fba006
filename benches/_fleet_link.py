"""The fleet bench's store link: one counting proxy per rank in front of the S3 test server,
every proxy drawing on one token bucket (the bucket's bandwidth, which all ranks share). The
proxy counts the bytes of the answers it forwards (outside fastload)."""

from __future__ import annotations

import socket
import threading
import time


class TokenBucket:
    """``rate`` bytes per second shared by every connection that takes from it (a burst of at
    most 256 KiB)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = 256 << 10
        self.tokens = 0.0
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(wait)


class CountingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``port``: counts the answer bytes it forwards
    (``sent``) and takes each from ``bucket`` first."""

    def __init__(self, port: int, bucket: TokenBucket) -> None:
        self.upstream, self.bucket = port, bucket
        self.sent = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(64 << 10):
                if answers:
                    self.bucket.take(len(data))
                    with self.lock:
                        self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.listener.close()


__all__ = ["CountingProxy", "TokenBucket"]
