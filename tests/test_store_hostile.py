"""Hostile input at the object storage entry points, refused before any request: nothing listens
on the endpoint, and none of these cases may get as far as one."""

from __future__ import annotations

import os

import pytest

import fastload
from fastload.core.errors import FastloadIOError

#: an endpoint nothing listens on; no retries, so a regression that does make a request is quick
OPTIONS = {
    "aws_endpoint": "http://127.0.0.1:9",
    "aws_region": "us-east-1",
    "aws_access_key_id": "AKIDEXAMPLE",
    "aws_secret_access_key": "wJalrXUtnFEMI",
    "max_retries": "0",
    "connect_timeout": "2s",
}


@pytest.fixture(autouse=True)
def _no_aws_files(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")


@pytest.mark.parametrize(
    "subfolder",
    ["%2e%2e/evil", "%2E%2E/evil", ".%2e/evil", "%2e./evil", "text/%2e%2e/%2e%2e/evil", "x/%2e%2e"],
)
def test_a_percent_encoded_dot_dot_subfolder_is_refused_like_dot_dot(subfolder):
    """The URL parser reads ``%2e%2e`` as ``..`` and resolves it: config and weights would come
    from outside the prefix."""
    with pytest.raises(FastloadIOError, match="leads outside s3://models/pre/") as caught:
        fastload.from_pretrained(
            "s3://models/pre/", subfolder=subfolder, storage_options=OPTIONS, progress=False
        )
    assert "[store-" not in str(caught.value)  # refused, not tried


def test_the_parsed_key_is_checked_whatever_the_spelling():
    """The guarantee behind the spelling check: the key the store reads must lie under the
    prefix, as the store's own parser reads both."""
    from fastload.hf import hub

    hub._check_inside("s3://models/pre/text/", "s3://models/pre/", "text", OPTIONS)
    with pytest.raises(FastloadIOError, match="leads outside"):
        hub._check_inside("s3://models/pre/%2e%2e/evil/", "s3://models/pre/", "x", OPTIONS)
    with pytest.raises(FastloadIOError, match="leads outside"):
        hub._check_inside("s3://models/pre/a/%2e%2e/", "s3://models/pre/", "x", OPTIONS)


def test_read_mode_mmap_is_refused_for_a_url_by_from_pretrained_as_by_load_file():
    from torch import nn

    for call in (
        lambda: fastload.load_file("s3://models/m.safetensors", read_mode="mmap"),
        lambda: fastload.from_pretrained(
            lambda: nn.Linear(2, 2),
            "s3://models/pre/model.safetensors",
            read_mode="mmap",
            storage_options=OPTIONS,
            progress=False,
        ),
    ):
        with pytest.raises(fastload.RequestError, match=r"read_mode='mmap' needs (a )?local file"):
            call()
