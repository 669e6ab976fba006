"""``fastload fetch`` against a real S3-compatible server (tests/support/s3_server.py): never a
weight file, never through a link planted in the directory, names up to the filesystem's limit, and
all of the files or none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from s3_server import FaultProxy, S3Server

import fastload
from fastload.core.checkpoint import new_files
from fastload.core.checkpoint.side_files import WEIGHT_PATTERNS
from fastload.tools.cli import main

pytest.importorskip("boto3")


def _prefix(env: S3Server, tmp_path: Path, key: str, files: dict[str, bytes]) -> str:
    local = tmp_path / "upload"
    local.mkdir()
    for name, data in files.items():
        (local / name).write_bytes(data)
    fastload.save_file({"w": torch.ones(4)}, local / "model.safetensors")
    return env.upload(local, "models", key)


def test_every_weight_format_is_left_out_even_for_the_pattern_star(env, tmp_path, capsys):
    weights = [p.replace("*", "model") for p in WEIGHT_PATTERNS] + ["MODEL.GGUF", "tf_model.H5"]
    for ext in ("gguf", "h5", "msgpack", "onnx", "ckpt", "npz"):  # the formats seen fetched
        assert f"*.{ext}" in WEIGHT_PATTERNS
    url = _prefix(
        env, tmp_path, "weights-never", {**dict.fromkeys(weights, b"w"), "config.json": b"{}"}
    )
    assert main(["fetch", url, str(tmp_path / "out"), "--pattern", "*"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json"]
    capsys.readouterr()


def test_the_help_and_the_docs_name_every_weight_format_left_out(capsys):
    with pytest.raises(SystemExit):
        main(["fetch", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    docs = Path(__file__).parents[2] / "docs" / "cli.md"
    documented = " ".join(docs.read_text(encoding="utf-8").split())
    for pattern in WEIGHT_PATTERNS:
        assert pattern in shown, pattern
        assert f"`{pattern}`" in documented, pattern


def test_a_link_planted_at_the_old_temporary_name_is_never_written_through(env, tmp_path):
    url = _prefix(env, tmp_path, "planted", {"config.json": b'{"a": 1}'})
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    (out / ".config.json.fastload-partial").symlink_to(outside)
    assert main(["fetch", url, str(out)]) == 0
    assert outside.read_text() == "precious"
    assert (out / "config.json").read_bytes() == b'{"a": 1}'


def test_a_file_whose_name_is_longer_than_a_temporary_name_allows_is_fetched(env, tmp_path):
    # 240 bytes: the old temporary, 18 bytes longer, was past the 255 bytes a name may have
    name = "t" * 235 + ".json"
    local = tmp_path / "long"
    local.mkdir()
    (local / name).write_bytes(b"{}")
    (local / "config.json").write_bytes(b"{}")
    url = env.place(local, "models", "long-name")  # s3s-fs's own upload cannot take the name
    assert main(["fetch", url, str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == sorted([name, "config.json"])


def test_a_fetch_that_fails_leaves_none_of_its_files(env, tmp_path, monkeypatch, capsys):
    from fastload.core.store import object_store

    url = _prefix(
        env, tmp_path, "too-big", {"a.json": b"{}", "b.json": b"{}", "c.json": b"x" * 4096}
    )
    monkeypatch.setattr(object_store, "MAX_SMALL_FILE", 1024)
    out = tmp_path / "out"
    assert main(["fetch", url, str(out)]) == 1
    assert "c.json" in capsys.readouterr().err
    assert os.listdir(out) == []  # neither a.json nor b.json, nor a temporary
    assert not any(p.startswith(new_files.PREFIX) for p in os.listdir(out))


def test_an_http_server_that_cannot_list_says_what_to_do(tmp_path, capsys):
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # its log would be in stderr too
            pass

    (tmp_path / "config.json").write_text("{}")
    handler = functools.partial(Quiet, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        assert main(["fetch", url, str(tmp_path / "out"), "-o", "max_retries=0"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "does not list its files" in err and "PROPFIND" in err, err
    assert "<html" not in err.lower()


#: every wait of the cases below; the client's timeouts are longer, so only a signal ends a fetch
BOUND = 60
NEVER = ["-o", "read_timeout=600s", "-o", "timeout=600s", "-o", "max_retries=0"]
#: the ``fastload`` script in a fresh interpreter, with Ctrl-C raising as in a terminal whatever
#: disposition of SIGINT the test run inherited (a background job, nohup)
CLI = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "import sys; from fastload.tools.cli import main; sys.exit(main())\n"
)


def _fetch_stopped_by(env, tmp_path: Path, sig: signal.Signals) -> tuple[str, Path, int, str]:
    """``fastload fetch`` of a.json, b.json and c.json in a child process, through a proxy that
    holds the GET of b.json: once it arrived (a.json's temporary written), ``sig`` is sent.
    Returns the URL, the output directory, the exit status and stderr."""
    files = {"a.json": b'{"a": 1}', "b.json": b'{"b": 2}', "c.json": b"{}"}
    url = _prefix(env, tmp_path, f"stopped-{sig.name.lower()}", files)
    out = tmp_path / "out"
    proxy = FaultProxy(env.port)
    held, release = threading.Event(), threading.Event()

    def on_get(path: str, start: int) -> None:
        if path.split("?")[0].endswith("/b.json"):
            held.set()
            release.wait(BOUND * 3)

    proxy.on_get = on_get
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    child = subprocess.Popen(
        [sys.executable, "-c", CLI, "fetch", url, str(out), *NEVER],
        env={**clean, **env.env(proxy.endpoint)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.wait(BOUND), "the GET of b.json never arrived"
        left = [name for name in os.listdir(out) if name.startswith(new_files.PREFIX)]
        assert len(left) == 1, os.listdir(out)  # a.json's, not yet renamed
        child.send_signal(sig)
        _, err = child.communicate(timeout=BOUND)
    except BaseException:
        child.kill()
        child.communicate()
        raise
    finally:
        release.set()
        proxy.close()
    return url, out, child.returncode, err


@pytest.mark.parametrize(
    ("sig", "status", "said"),
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_fetch_stopped_by_a_signal_leaves_no_temporary(env, tmp_path, sig, status, said):
    _, out, code, err = _fetch_stopped_by(env, tmp_path, sig)
    assert code == status, err
    assert err.strip() == f"fastload: error: {said}"
    assert os.listdir(out) == []


def test_the_next_fetch_removes_the_temporary_a_killed_fetch_left(env, tmp_path, capsys):
    url, out, code, _ = _fetch_stopped_by(env, tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL
    (left,) = os.listdir(out)  # SIGKILL cannot be caught: a.json's temporary stays
    assert left.startswith(new_files.PREFIX)
    assert main(["fetch", url, str(out)]) == 0
    assert sorted(os.listdir(out)) == ["a.json", "b.json", "c.json"]
    assert (out / "b.json").read_bytes() == b'{"b": 2}'
    capsys.readouterr()
