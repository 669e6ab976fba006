"""The classes of object storage failures, the same at every entry point: missing credentials
are ``[store-denied]`` (not an outage after minutes of retries against the instance metadata
endpoint), and ``fastload fetch`` reports a denied credential or a missing bucket as
``load_file`` does."""

from __future__ import annotations

import socket
import threading

import pytest
from s3_fixtures import clear_aws_environment

import fastload
from fastload.core.basics.errors import FastloadFileNotFoundError, FastloadPermissionError
from fastload.tools.cli import main


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS credentials anywhere: not in the environment, not in the files."""
    clear_aws_environment(monkeypatch)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")


class _Stalling:
    """A server on 127.0.0.1 that accepts connections and never answers: a stalled metadata
    endpoint."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.listener.close()
        for c in self.held:
            c.close()


@pytest.mark.parametrize("metadata", ["refused", "stalled"])
def test_no_credentials_anywhere_is_store_denied_saying_so(no_credentials, metadata):
    stalling = _Stalling() if metadata == "stalled" else None
    endpoint = f"http://127.0.0.1:{stalling.port}" if stalling else "http://127.0.0.1:9"
    options = {"aws_metadata_endpoint": endpoint, "max_retries": "1", "connect_timeout": "2s"}
    try:
        with pytest.raises(FastloadPermissionError) as caught:
            fastload.load_file("s3://models/m.safetensors", storage_options=options)
    finally:
        if stalling:
            stalling.close()
    message = str(caught.value)
    assert "[store-denied]" in message and "no AWS credentials found" in message, message


def test_explicit_credentials_never_ask_the_metadata_endpoint(no_credentials):
    """The fallback is the last resort: keys given, a refused store is an outage, as before."""
    options = {
        "aws_access_key_id": "AKIDEXAMPLE",
        "aws_secret_access_key": "secret",
        "max_retries": "0",
        "connect_timeout": "2s",
    }
    with pytest.raises(fastload.FastloadIOError) as caught:
        fastload.load_file("s3://models/m.safetensors", storage_options=options)
    assert "[store-unavailable]" in str(caught.value)


# --- against the S3 server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("boto3")
    from s3_server import S3Server

    s3 = S3Server(tmp_path_factory.mktemp("s3-root"))
    s3.bucket("models")
    yield s3
    s3.stop()


@pytest.fixture
def env(server, monkeypatch: pytest.MonkeyPatch):
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    return server


def _fetch_error(url: str, tmp_path, capsys) -> str:
    assert main(["fetch", url, str(tmp_path / "out"), "-o", "max_retries=0"]) == 1
    return capsys.readouterr().err


def test_fetch_reports_a_denied_credential_and_a_missing_bucket_as_load_file_does(
    env, tmp_path, capsys, monkeypatch
):
    config = tmp_path / "config.json"
    config.write_text("{}")
    env.upload(config, "models", "fetch-classes/config.json")

    with pytest.raises(FastloadFileNotFoundError, match=r"\[store-not-found\]"):
        fastload.load_file("s3://no-such-bucket/m.safetensors")
    assert "[store-not-found]" in _fetch_error("s3://no-such-bucket/", tmp_path, capsys)

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-wrong-secret")
    with pytest.raises(FastloadPermissionError, match=r"\[store-denied\]"):
        fastload.load_file("s3://models/fetch-classes/config.json")
    assert "[store-denied]" in _fetch_error("s3://models/fetch-classes/", tmp_path, capsys)
