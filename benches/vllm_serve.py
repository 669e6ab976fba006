"""``vllm serve`` from process start to the first token, as a user starting a server feels it
(for benches/vllm_bench.py and benches/vllm_s3_bench.py, ``--serve``).

One run: the clock starts just before ``python -m vllm.entrypoints.openai.api_server --model M
--load-format F ...`` is started (what ``vllm serve M`` runs; on a Unix socket of its own, the
engine in its own process as vLLM runs it by default), and stops when the answer to a completions
request for one token arrives, the request sent as soon as the socket accepts connections. From
the server's log: vLLM's "Loading weights took" (the loader's ``load_weights``), the loader's part
of the start; vLLM's CPU post-processing (the same work for every format) is measured by the
engine runs in process (``post_s``) and reported apart there.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

#: the serving options of every run (as benches/vllm_bench.py's engine runs)
SERVE_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128"]
SERVE_ARGS += ["--max-num-seqs", "4", "--seed", "0"]


def serve_argv(model: str, kwargs: dict[str, Any], uds: str) -> list[str]:
    """The ``vllm serve`` command line of a load format given as ``LLM(...)`` keyword
    arguments (``load_format``, ``safetensors_load_strategy``, ``model_loader_extra_config``)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return [*argv, "--uds", uds, *SERVE_ARGS]


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def _first_token(uds: str, model: str, timeout: float) -> list[int]:
    connection = _Unix(uds, timeout)
    try:
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 1}
        body |= {"temperature": 0, "return_token_ids": True}
        connection.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"completions answered {response.status}: {text[:300]}")
    return list(json.loads(text)["choices"][0]["token_ids"])


def serve_first_token(
    model: str, name: str, kwargs: dict[str, Any], mode: str, timeout: float = 1800
) -> dict[str, Any]:
    """One ``vllm serve`` run (the caller set the cache state ``mode``): ``serve_s`` from process
    start to the first token, ``serve_weights_s`` from vLLM's log, ``tokens``; ``error`` instead
    where it failed."""
    uds = str(Path(tempfile.mkdtemp()) / "vllm.sock")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    log = tempfile.TemporaryFile(mode="w+")
    result: dict[str, Any] = {"format": f"{name} (vllm serve)", "mode": mode}
    start = time.perf_counter()
    proc = subprocess.Popen(
        serve_argv(model, kwargs, uds),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its engine process goes down with it
    )
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
    timer.start()
    try:
        while proc.poll() is None:
            try:
                result["tokens"] = _first_token(uds, model, timeout)
                result["serve_s"] = time.perf_counter() - start
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.05)  # not listening yet
    except Exception as e:  # the run's failure is its result
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        timer.cancel()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()
    log.seek(0)
    text = log.read()
    if took := re.search(r"Loading weights took ([0-9.]+) seconds", text):
        result["serve_weights_s"] = float(took.group(1))
    if "tokens" not in result and "error" not in result:
        errors = [ln for ln in text.splitlines() if re.search(r"\w+(Error|Exception)\b", ln)]
        result["error"] = (errors[-1] if errors else text[-500:]).strip()[-400:]
    return result


__all__ = ["serve_argv", "serve_first_token"]
