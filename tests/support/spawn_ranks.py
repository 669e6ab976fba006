"""Helpers for tests that spawn torch.distributed ranks on this machine (gloo, loopback only)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., None], args: tuple[object, ...], *, world: int, timeout_s: float, what: str
) -> None:
    """Spawns ``world`` ranks of ``fn(rank, *args)`` and waits at most ``timeout_s``; a rank's
    exception is re-raised here, and ranks still alive at the deadline are killed."""
    context = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} ranks did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def rank_results(root: str | Path, world: int) -> list[dict[str, object]]:
    """What each rank wrote to ``rank{r}.json`` under ``root`` (the ranks' way of answering a
    test: a rank's exception is written there as ``error``, for the test to show)."""
    return [json.loads((Path(root) / f"rank{r}.json").read_text()) for r in range(world)]


def tcp_bytes_received(pid: int | None = None) -> int | None:
    """Bytes the TCP connections of process ``pid`` (default: this one) have received so far,
    as the kernel counts them (``ss``'s ``bytes_received``); ``None`` where ``ss`` is missing.
    A rank's gloo traffic, measured outside torch and fastload."""
    import os
    import re
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        return None
    pid = os.getpid() if pid is None else pid
    lines = subprocess.run(
        ["ss", "-tinpH"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    total, ours = 0, False
    for line in lines:
        if not line.startswith((" ", "\t")):  # a socket's line, then its info line
            ours = f"pid={pid}," in line
        elif ours and (m := re.search(r"bytes_received:(\d+)", line)):
            total += int(m.group(1))
    return total


def tcp_connections(pid: int | None = None) -> list[tuple[str, str, int]]:
    """``(local address, remote address, bytes received)`` of each TCP connection process
    ``pid`` (default: this one) holds, as the kernel counts them (``ss``); empty without ``ss``."""
    import os
    import re
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        return []
    pid = os.getpid() if pid is None else pid
    lines = subprocess.run(
        ["ss", "-tinpH"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    out: list[tuple[str, str, int]] = []
    ends: tuple[str, str] | None = None
    for line in lines:
        if not line.startswith((" ", "\t")):  # a socket's line, then its info line
            fields = line.split()
            ends = (fields[3], fields[4]) if f"pid={pid}," in line else None
        elif ends is not None:
            m = re.search(r"bytes_received:(\d+)", line)
            out.append((*ends, int(m.group(1)) if m else 0))
            ends = None
    return out


def leave_group() -> None:
    """A rank's last step: every rank done before any tears its connections down, then this
    process gone at once, with nothing torn down. gloo aborts a process ("terminate called
    without an active exception", SIGABRT) whose group sees a peer's connection close while the
    group is still up: a rank that destroyed its group (or exited) right after the barrier could
    do that to a rank still on its way out of it, the wider the window the busier the machine
    (destroying a group takes milliseconds; the exit here, microseconds). Called while an
    exception propagates (from a ``finally``), it returns after the barrier, so the rank still
    fails with it."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    if sys.exc_info()[0] is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_store_rank(rank: int, world: int, port: int, timeout_s: float) -> None:
    """A spawned rank of a collective load from the tests' S3 server: none of the machine's AWS
    configuration (the test's storage_options give the credentials), no progress bars, one torch
    thread, and a gloo group on loopback whose collective calls wait at most ``timeout_s`` (the
    backstop of a hang)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[key]
    os.environ.update(
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent/credentials",
        AWS_CONFIG_FILE="/nonexistent/config",
        FASTLOAD_DISABLE_PROGRESS_BARS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
