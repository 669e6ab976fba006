"""Hostile input at the object storage entry points, refused before any request: nothing listens
on the endpoint, and none of these cases may get as far as one."""

from __future__ import annotations

import pytest
from s3_fixtures import UNREACHABLE, clear_aws_environment

import fastload
from fastload.core.basics.errors import FastloadIOError


@pytest.fixture(autouse=True)
def _no_aws_files(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_aws_environment(monkeypatch)


@pytest.mark.parametrize(
    "subfolder",
    ["%2e%2e/evil", "%2E%2E/evil", ".%2e/evil", "%2e./evil", "text/%2e%2e/%2e%2e/evil", "x/%2e%2e"],
)
def test_a_percent_encoded_dot_dot_subfolder_is_refused_like_dot_dot(subfolder):
    """The URL parser reads ``%2e%2e`` as ``..`` and resolves it: config and weights would come
    from outside the prefix."""
    with pytest.raises(FastloadIOError, match="leads outside s3://models/pre/") as caught:
        fastload.from_pretrained(
            "s3://models/pre/", subfolder=subfolder, storage_options=UNREACHABLE, progress=False
        )
    assert "[store-" not in str(caught.value)  # refused, not tried


def test_the_parsed_key_is_checked_whatever_the_spelling():
    """The guarantee behind the spelling check: the key the store reads must lie under the
    prefix, as the store's own parser reads both."""
    from fastload.hf import hub

    hub._check_inside("s3://models/pre/text/", "s3://models/pre/", "text", UNREACHABLE)
    with pytest.raises(FastloadIOError, match="leads outside"):
        hub._check_inside("s3://models/pre/%2e%2e/evil/", "s3://models/pre/", "x", UNREACHABLE)
    with pytest.raises(FastloadIOError, match="leads outside"):
        hub._check_inside("s3://models/pre/a/%2e%2e/", "s3://models/pre/", "x", UNREACHABLE)


def test_read_mode_mmap_is_refused_for_a_url_by_from_pretrained_as_by_load_file():
    from torch import nn

    for call in (
        lambda: fastload.load_file("s3://models/m.safetensors", read_mode="mmap"),
        lambda: fastload.from_pretrained(
            lambda: nn.Linear(2, 2),
            "s3://models/pre/model.safetensors",
            read_mode="mmap",
            storage_options=UNREACHABLE,
            progress=False,
        ),
    ):
        with pytest.raises(fastload.RequestError, match=r"read_mode='mmap' needs (a )?local file"):
            call()
