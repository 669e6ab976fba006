"""The S3-compatible server fixtures shared by the object storage tests (a plugin of
tests/conftest.py): one server per module, and the AWS variables a user sets pointing at it. A test
module that needs another server defines its own ``server`` and ``env``, which win."""

from __future__ import annotations

import os

import pytest
from s3_server import S3Server

#: options of a store nothing listens on (no retries): a regression that makes a request fails
#: quickly instead of reaching anything
UNREACHABLE = {
    "aws_endpoint": "http://127.0.0.1:9",
    "aws_region": "us-east-1",
    "aws_access_key_id": "AKIDEXAMPLE",
    "aws_secret_access_key": "wJalrXUtnFEMI",
    "max_retries": "0",
    "connect_timeout": "2s",
}


def clear_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No AWS variable from the machine, and none of the profile files."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s3 = S3Server(tmp_path_factory.mktemp("s3-root"))
    s3.bucket("models")
    yield s3
    s3.stop()


@pytest.fixture
def env(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The AWS variables a user sets, pointing at the server; none of the profile files."""
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    return server
