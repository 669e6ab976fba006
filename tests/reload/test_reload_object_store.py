"""fastload.reload from object storage (issue 44): a sharded checkpoint at an s3:// URL into a
model loaded from one, or from local files, in place; with digests only the changed tensors are
requested. Against the S3-compatible server of tests/support/s3_server.py (skipped without it)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastload

pytest.importorskip("boto3")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(128, 128) for _ in range(4)))


def test_reload_from_a_url_into_a_model_loaded_from_one(env, tmp_path):
    base = _model(1)
    changed = copy.deepcopy(base)
    with torch.no_grad():
        changed[3].bias.add_(1.0)
    for name, model in (("a", base), ("b", changed)):
        fastload.save_pretrained(model, tmp_path / name, max_shard_size="100KB", digests=True)
    url_a = env.upload(tmp_path / "a", "models", "reload/a")
    url_b = env.upload(tmp_path / "b", "models", "reload/b")
    model = fastload.from_pretrained(lambda: _model(9), url_a, progress=False)
    before = {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}
    report = fastload.reload(model, url_b)
    assert (report.tensors_read, report.tensors_unchanged) == (1, 7)
    report = fastload.reload(model, url_b, skip_unchanged=False, atomic=True)
    assert report.tensors_read == 8
    assert {n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()} == before
    for name, value in changed.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_reload_from_a_url_into_a_model_loaded_from_local_files(env, tmp_path):
    fastload.save_pretrained(_model(1), tmp_path / "a", max_shard_size="100KB")
    fastload.save_pretrained(_model(2), tmp_path / "b", max_shard_size="100KB")
    url_b = env.upload(tmp_path / "b", "models", "reload-local/b")
    model = fastload.from_pretrained(lambda: _model(9), tmp_path / "a", progress=False)
    fastload.reload(model, url_b)
    for name, value in _model(2).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
