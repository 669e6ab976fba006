"""No message or log line carries a URL's query (a presigned signature, a SAS token) or its
user-info (``user:PASSWORD@``, ``KEY:SECRET@``): one redaction for every entry point, whichever
side (Rust or Python) wrote the message. Nothing listens on the endpoints: every case fails,
and what it says is checked."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from http_store import HttpStore
from s3_fixtures import clear_aws_environment
from torch import nn

import fastload
from fastload.core.basics.errors import FastloadError, FastloadIOError
from fastload.core.basics.redaction import redact
from fastload.tools.cli import main

SECRETS = ("PASSWORD", "SIGSECRET", "KEYSECRET")
QUICK = {"max_retries": "0", "connect_timeout": "2s"}
#: every wait of a case on a subprocess or a served request (nothing here waits on a clock)
BOUND = 120
#: URLs that carry secrets, as users write them
URLS = [
    "http://user:PASSWORD@127.0.0.1:9/m.safetensors?sig=SIGSECRET",
    "https://127.0.0.1:9/m.safetensors?X-Amz-Signature=SIGSECRET&X-Amz-Credential=KEYSECRET",
    "http://user:PASSWORD@127.0.0.1:9/pytorch_model.bin?sig=SIGSECRET",
    "http://user:PASSWORD@127.0.0.1:9/prefix/",
]


@pytest.fixture(autouse=True)
def _no_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_aws_environment(monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")


def _clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text


def _raised(call) -> FastloadError:
    with pytest.raises(FastloadError) as caught:
        call()
    error = caught.value
    _clean(str(error))
    _clean(repr(error))
    _clean(" ".join(str(a) for a in error.args))
    if isinstance(error, FastloadIOError):
        _clean(str(error.filename))
    return error


@pytest.mark.parametrize("url", URLS)
def test_load_file_safe_open_and_from_pretrained_never_show_a_secret(url):
    _raised(lambda: fastload.load_file(url, storage_options=QUICK))
    _raised(lambda: fastload.safe_open(url, storage_options=QUICK))
    _raised(lambda: fastload.from_pretrained(url, storage_options=QUICK, progress=False))


@pytest.mark.parametrize("url", [*URLS, "s3://KEYSECRET:PASSWORD@models/m.safetensors?x=SIGSECRET"])
@pytest.mark.parametrize("command", ["inspect", "verify", "fetch"])
def test_the_cli_never_shows_a_secret(url, command, capsys, tmp_path, monkeypatch):
    argv = [command, url] + ([str(tmp_path / "out")] if command == "fetch" else [])
    argv += ["-o", "max_retries=0", "--storage-option", "connect_timeout=2s"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    _clean(captured.out + captured.err)
    assert len(captured.err.strip().splitlines()) == 1, captured.err


def test_every_fastload_error_is_redacted_whoever_makes_it():
    for cls in (FastloadError, fastload.CheckpointError, fastload.RequestError, FastloadIOError):
        error = cls("s3://KEYSECRET:PASSWORD@b/k?sig=SIGSECRET: broken")
        assert str(error) == "s3://<credentials hidden>@b/k?<query hidden>: broken"


def test_a_log_line_of_the_fastload_logger_is_redacted(caplog):
    with caplog.at_level(logging.INFO, logger="fastload"):
        logging.getLogger("fastload").warning("%s: not used", URLS[0])
    _clean(caplog.text)
    assert "http://<credentials hidden>@127.0.0.1:9/m.safetensors?<query hidden>" in caplog.text


def test_the_python_and_rust_sides_share_one_rule():
    from fastload import _core

    text = "GET http://u:PASSWORD@h/k?sig=SIGSECRET (az://c/k?sv=1&sig=SIGSECRET)"
    assert redact(text) == _core.redact_urls(text)
    _clean(redact(text))
    assert redact("/local/path: no URL here") == "/local/path: no URL here"


# -- every entry point that shows a checkpoint's URL, against a served checkpoint ----------------
# The reports and the notes name the checkpoint read; their values are made from the store's
# root, which never holds the user-info (the client keeps the URL as given to fetch).


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))


@pytest.fixture
def http_store(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        fastload.save_pretrained(_model(seed), tmp_path / "store" / name)
    fastload.save_pretrained(_model(3), tmp_path / "store" / "sharded", max_shard_size="10KB")
    store = HttpStore(tmp_path / "store")
    yield store
    store.close()


def _hidden(text: str) -> None:
    """``text`` names the served URL with its user-info hidden, and no secret."""
    _clean(text)
    assert "http://<credentials hidden>@127.0.0.1:" in text, text


def test_an_object_store_shows_its_url_without_the_user_info(http_store):
    from fastload.core.store.object_store import open_store

    store = open_store(http_store.url("a/model.safetensors", user_info="user:PASSWORD"))
    for shown in (store.url, store.url_of(store.key), repr(store)):
        _hidden(shown)
    [file] = store.open([store.key])  # the client still reads with the URL as given
    _hidden(file.path)
    handle = fastload.safe_open(http_store.url("a/model.safetensors", user_info="user:PASSWORD"))
    _hidden(repr(handle))
    handle.close()


@pytest.mark.parametrize("where", ["a/", "sharded/"])
def test_a_load_report_never_shows_the_user_info(http_store, where):
    url = http_store.url(where, user_info="user:PASSWORD")
    model, report = fastload.from_pretrained(
        lambda: _model(), url, progress=False, output_loading_info=True
    )
    for shown in (report.summary(), str(report), repr(report), *report.files, *report.sharing):
        _clean(shown)
    _hidden(report.summary())
    _hidden(repr(report))
    assert report.files and all(f.startswith("http://<credentials hidden>@") for f in report.files)


def test_a_reload_report_never_shows_the_user_info(http_store):
    model = fastload.from_pretrained(
        lambda: _model(), http_store.url("a/", user_info="user:PASSWORD"), progress=False
    )
    url = http_store.url("b/", user_info="user:PASSWORD")
    for atomic in (False, True):
        report = fastload.reload(model, url, atomic=atomic)
        assert report.tensors_read == 4
        _hidden(report.source)
        for shown in (str(report), repr(report), report.summary(), json.dumps(report.to_dict())):
            _hidden(shown)
        assert report.files
        assert all(f.startswith("http://<credentials hidden>@") for f in report.files)
    for name, value in _model(2).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_report_field_set_later_is_stored_redacted():
    from fastload.core.plan.report import LoadReport
    from fastload.reloading.report import ReloadReport

    secret = "s3://KEYSECRET:PASSWORD@b/k?sig=SIGSECRET"
    report = LoadReport()
    report.files = [secret]
    report.sharing = {secret: "copies"}
    report.model_class = secret
    reloaded = ReloadReport(source=secret, files=[secret])
    for shown in (report.summary(), repr(report), repr(reloaded), str(reloaded.to_dict())):
        _clean(shown)
    assert reloaded.source == "s3://<credentials hidden>@b/k?<query hidden>"


#: a model loaded from one served checkpoint, then reloaded in place from another whose tensor
#: data never comes: interrupted there, it prints the interrupt's notes. Python's SIGINT handler
#: first: a test run that started with SIGINT ignored (a background job, nohup) passes it on
_INTERRUPTED_RELOAD = """
import signal; signal.signal(signal.SIGINT, signal.default_int_handler)
import sys, torch, fastload
from torch import nn
options = {"read_timeout": "600s", "timeout": "600s", "max_retries": "0"}
torch.manual_seed(0)
model = fastload.from_pretrained(
    lambda: nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), sys.argv[1], progress=False,
    storage_options=options,
)
print("loaded", flush=True)
try:
    fastload.reload(model, sys.argv[2], skip_unchanged=False)
except KeyboardInterrupt as e:
    print("interrupted")
    print("\\n".join(getattr(e, "__notes__", [])))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_the_note_on_an_interrupted_reload_never_shows_the_user_info(http_store):
    http_store.stall("b/model.safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    argv = [http_store.url(f"{d}/", user_info="user:PASSWORD") for d in ("a", "b")]
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_RELOAD, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert http_store.stalled.wait(BOUND), "the stalled request never arrived"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=BOUND)
    except BaseException:
        child.kill()
        child.communicate()
        raise
    assert child.returncode == 0 and "interrupted" in out, err
    assert "fastload.reload failed while reading" in out, out
    _hidden(out + err)


def test_inspect_json_never_shows_the_user_info_or_the_query(http_store):
    url = http_store.url("sharded/", user_info="user:PASSWORD", query="sig=SIGSECRET")
    done = subprocess.run(
        [sys.executable, "-m", "fastload.tools.cli", "inspect", url, "--json"],
        capture_output=True,
        text=True,
        timeout=BOUND,
        env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
    )
    assert done.returncode == 0, done.stderr
    _hidden(done.stdout + done.stderr)
    info = json.loads(done.stdout)
    hidden = url.replace("user:PASSWORD@", "<credentials hidden>@")
    assert info["path"] == hidden.replace("?sig=SIGSECRET", "?<query hidden>")
    assert len(info["files"]) > 1 and info["tensors"] == 4
    for f in info["files"]:
        assert f["path"].startswith("http://<credentials hidden>@127.0.0.1:"), f["path"]


# -- vLLM: the reload's log line and notes, through a logger fastload did not set up -------------


def _vllm_reload(source: str, log: logging.Logger):
    """A vLLM reload of ``source`` in progress
    (:class:`~fastload.integrations.vllm.reload_run._Reload`) on a small model, as ``open_reload``
    makes it, with ``log`` as vLLM's logger."""
    from fastload.integrations.vllm.reload_run import _Reload
    from fastload.integrations.vllm.reload_state import Held

    model = _model()
    held = Held(
        model_arg="/srv/model",
        source=source,
        catalog=None,
        digests={},
        feeds={},
        numel={},
    )
    return _Reload(
        model,
        SimpleNamespace(model=source, model_weights="", revision=None),
        held,
        SimpleNamespace(bytes=1 << 20),
        iter(()),
        source=source,
        catalog=None,
        digests={},
        left_out=set(),
        watch=SimpleNamespace(engine_bytes=0),
        log=log,
    )


def _vllm_logger() -> logging.Logger:
    """A logger as vLLM's ``init_logger`` makes one: outside ``fastload``, no filter."""
    log = logging.getLogger("vllm.test_redaction")
    log.filters.clear()
    return log


def test_vllm_the_reloaded_line_never_shows_the_user_info(caplog):
    url = "http://user:PASSWORD@127.0.0.1:9/m/?sig=SIGSECRET"
    log = _vllm_logger()
    reload = _vllm_reload(url, log)
    with caplog.at_level(logging.INFO, logger=log.name):
        reload.finish()
    assert "fastload: reloaded http://<credentials hidden>@127.0.0.1:9/m/?<query hidden>" in (
        caplog.text
    )
    _clean(caplog.text)
    # the engine re-reads what it holds as given (a reload naming no path)
    assert reload.record.source == url
    with caplog.at_level(logging.INFO, logger=log.name):  # anything else logged there
        log.info("fastload: reading %s", url)
    _clean(caplog.text)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("a weight loader failed")])
def test_vllm_the_note_of_a_failed_reload_never_shows_the_user_info(monkeypatch, exc):
    from fastload.integrations.vllm import reload_run as vllm_reload

    url = "http://user:PASSWORD@127.0.0.1:9/m/?sig=SIGSECRET"
    reload = _vllm_reload(url, _vllm_logger())
    # vLLM's layerwise state, no layer filled yet: the engine keeps its previous weights
    monkeypatch.setattr(vllm_reload, "_layerwise", lambda: ({}, lambda *a: None))
    with pytest.raises(type(exc)) as caught:
        reload.recover(exc)
    shown = " ".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    assert "keeps its previous weights (http://<credentials hidden>@127.0.0.1:9/m/" in shown
    _clean(shown)
