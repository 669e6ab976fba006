"""The S3-compatible server fixtures shared by the object storage tests (a plugin of
tests/conftest.py): one server per module, and the AWS variables a user sets pointing at it. A test
module that needs another server defines its own ``server`` and ``env``, which win."""

from __future__ import annotations

import pytest

from s3_server import S3Server


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
