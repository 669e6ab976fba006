"""Fixtures for tests of ``fastload.patch_transformers()``, registered for the whole suite by
``pytest_plugins`` in conftest.py; a module opts in with
``pytestmark = pytest.mark.usefixtures("unpatched")``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Undoes the patch after the test, whatever the test did."""
    yield
    import fastload

    fastload.unpatch_transformers()


@pytest.fixture
def transformers_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the models transformers' own weight loading ran for."""
    from transformers.modeling_utils import PreTrainedModel

    calls: list[str] = []
    real = PreTrainedModel.__dict__["_load_pretrained_model"]

    def counting(*args, **kwargs):
        calls.append(type(args[0]).__name__ if args else "?")
        return real.__func__(*args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "_load_pretrained_model", staticmethod(counting))
    return calls
