"""Store configuration values a client cannot use: a credential or an endpoint with a character a
request cannot carry (a newline left from a file, a space), a value it cannot parse. Each is a
``RequestError [store-config]`` naming the key and where it came from, before any request, never
the value and never a Rust panic (``pyo3_runtime.PanicException``, which ``except Exception``
does not catch). No server is needed: nothing listens on the endpoint, and none of these cases
may get as far as a request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from s3_fixtures import UNREACHABLE, clear_aws_environment

import fastload
from fastload.core.basics.errors import RequestError


@pytest.fixture(autouse=True)
def _no_aws_files(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_aws_environment(monkeypatch)


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("aws_access_key_id", "AKIDSECRETVALUE\n", "line break"),
        ("aws_secret_access_key", "SECRETVALUE\r\n", "line break"),
        ("aws_session_token", "SECRETVALUE-token\n", "line break"),
        ("aws_session_token", "SECRET VALUE", "a space"),
        ("aws_endpoint", "http://127.0 .0.1:9", "a space"),
        ("aws_endpoint", "http://127.0.0.1:9/SECRETVALUE path", "a space"),
        ("aws_endpoint", "SECRETVALUE.example", "not an http"),
        ("aws_region", "us east SECRETVALUE", "a space"),
        ("timeout", "SECRETVALUE", "not a duration"),
        ("read_timeout", "thirty SECRETVALUE", "not a duration"),
        ("aws_checksum_algorithm", "md5SECRETVALUE", "not one of"),
        ("allow_http", "SECRETVALUE", "not true or false"),
    ],
)
def test_an_unusable_option_value_is_a_config_error_naming_the_key_never_the_value(key, value, why):
    with pytest.raises(RequestError) as caught:
        fastload.load_file("s3://models/m.safetensors", storage_options={**UNREACHABLE, key: value})
    message = str(caught.value)
    assert "[store-config]" in message and f"'{key}'" in message and why in message, message
    assert "SECRETVALUE" not in message, message


def test_an_environment_variable_with_a_newline_is_named_as_the_variable(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "SECRETVALUE\n")
    options = {k: v for k, v in UNREACHABLE.items() if k != "aws_session_token"}
    with pytest.raises(RequestError, match=r"environment variable AWS_SESSION_TOKEN") as caught:
        fastload.load_file("s3://models/m.safetensors", storage_options=options)
    assert "SECRETVALUE" not in str(caught.value)


def test_the_cli_reports_a_credential_with_a_newline_in_one_line_without_a_panic():
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
        "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE\n",
        "AWS_SECRET_ACCESS_KEY": "SECRETVALUE",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
        "AWS_CONFIG_FILE": "/nonexistent/config",
    }
    done = subprocess.run(
        [sys.executable, "-m", "fastload.tools.cli", "inspect", "s3://models/m.safetensors"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "AWS_ACCESS_KEY_ID" in lines[0] and "[store-config]" in lines[0], lines[0]
    assert "panicked" not in done.stderr and "SECRETVALUE" not in done.stderr


def test_an_http_store_option_is_checked_as_well():
    with pytest.raises(RequestError, match=r"'timeout'.*not a duration"):
        fastload.load_file("http://127.0.0.1:9/m.safetensors", storage_options={"timeout": "1 x"})
