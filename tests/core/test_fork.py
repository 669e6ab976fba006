"""Loads in a forked child: a process that loaded once and then forks (``multiprocessing`` with the
Linux default, DataLoader workers, pre-fork servers) loads again in the child. The parent's copy
threads and store runtime do not exist there; the child must start its own, never wait on them.

Each case runs in a fresh interpreter; the parent bounds the child's load (a hang is killed and
reported), and the interpreter itself runs under a timeout."""

from __future__ import annotations

import os

import pytest
from fresh import run_script

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")

#: the script's part that loads, forks, loads in the child (bounded) and compares
_FORKING = """
import multiprocessing, os, sys, time
import torch, fastload

source, how = sys.argv[1], sys.argv[2]
CHILD_LIMIT = 60  # seconds; a hung child is killed and the test fails

def load():
    return fastload.load_file(source)

first = load()  # the default thread count: builds and caches the copy pools

def child_load() -> None:
    again = load()
    same = list(again) == list(first) and all(torch.equal(again[k], first[k]) for k in first)
    os._exit(0 if same else 3)

if how == "fork":
    pid = os.fork()
    if pid == 0:
        try:
            child_load()
        finally:
            os._exit(4)
    deadline = time.monotonic() + CHILD_LIMIT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            sys.exit("the forked child's load hung")
        time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
else:
    worker = multiprocessing.get_context("fork").Process(target=child_load)
    worker.start()
    worker.join(CHILD_LIMIT)
    if worker.is_alive():
        worker.kill()
        worker.join()
        sys.exit("the multiprocessing worker's load hung")
    code = worker.exitcode
assert code == 0, f"the child's load failed (exit status {code})"
assert list(load()) == list(first)  # and the parent still loads
print("ok")
"""


def _tensors():
    import torch

    gen = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(512, 1024, generator=gen),
        "half": torch.randn(256, 256, generator=gen).to(torch.float16),
        "ids": torch.arange(100, dtype=torch.int64),
    }


@pytest.mark.parametrize("how", ["fork", "multiprocessing"])
def test_a_forked_child_loads_a_local_file_after_its_parent_did(tmp_path, how):
    import fastload

    path = tmp_path / "model.safetensors"
    fastload.save_file(_tensors(), path)
    assert run_script(_FORKING, path, how, timeout=240).strip().endswith("ok")


@pytest.mark.parametrize("how", ["fork", "multiprocessing"])
def test_a_forked_child_loads_from_object_storage_after_its_parent_did(tmp_path, how):
    pytest.importorskip("boto3")
    from s3_server import S3Server

    import fastload

    path = tmp_path / "model.safetensors"
    fastload.save_file(_tensors(), path)
    (tmp_path / "s3-root").mkdir()
    server = S3Server(tmp_path / "s3-root")
    try:
        server.bucket("models")
        url = server.upload(path, "models", "fork/model.safetensors")
        env = {
            **os.environ,
            **server.env(),
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
            "AWS_CONFIG_FILE": "/nonexistent/config",
        }
        out = run_script(_FORKING, url, how, env=env, timeout=240)
    finally:
        server.stop()
    assert out.strip().endswith("ok")
