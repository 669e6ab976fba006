"""No message or log line carries a URL's query (a presigned signature, a SAS token) or its
user-info (``user:PASSWORD@``, ``KEY:SECRET@``): one redaction for every entry point, whichever
side (Rust or Python) wrote the message. Nothing listens on the endpoints: every case fails,
and what it says is checked."""

from __future__ import annotations

import logging

import pytest

import fastload
from fastload.core.errors import FastloadError, FastloadIOError
from fastload.core.redaction import redact
from fastload.tools.cli import main
from s3_fixtures import clear_aws_environment

SECRETS = ("PASSWORD", "SIGSECRET", "KEYSECRET")
QUICK = {"max_retries": "0", "connect_timeout": "2s"}
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
