"""A bad index or side file in object storage is the checkpoint's fault, as it would be of a
local one: ``CheckpointError``, never ``[store-config]`` (which says the caller's configuration
is wrong). Against the S3-compatible server of tests/support/s3_server.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fastload
from fastload.core.basics.errors import CheckpointError
from fastload.core.store import object_store

pytest.importorskip("boto3")


def _sharded(directory: Path, shard_name: str) -> Path:
    directory.mkdir()
    fastload.save_file({"w": torch.ones(4)}, directory / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"w": shard_name}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


@pytest.mark.parametrize("shard", [".", "sub/..", "./"])
def test_a_shard_named_as_the_directory_is_a_checkpoint_error_as_locally(env, tmp_path, shard):
    from fastload.core.checkpoint.files import resolve
    from fastload.core.checkpoint.opened import open_checkpoint

    local = _sharded(tmp_path / "ckpt", shard)
    url = env.upload(local, "models", f"dot-shard-{len(shard)}")
    with pytest.raises(CheckpointError) as here:
        open_checkpoint(resolve(local))
    with pytest.raises(CheckpointError) as remote:
        object_store.open_checkpoint(url)
    assert "[store-" not in str(remote.value)
    assert str(remote.value).split(": ", 1)[1] == str(here.value).split(": ", 1)[1]


def test_an_index_over_the_limit_is_a_checkpoint_error_naming_the_limit(env, tmp_path, monkeypatch):
    local = _sharded(tmp_path / "ckpt", "model-00001-of-00001.safetensors")
    url = env.upload(local, "models", "big-index")
    monkeypatch.setattr(object_store, "MAX_SMALL_FILE", 16)
    with pytest.raises(CheckpointError, match=r"more than the 16 bytes.*\[file-too-large\]"):
        object_store.open_checkpoint(url)


def test_a_config_over_the_limit_is_a_checkpoint_error(env, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tiny_models import make_model, save_checkpoint

    local = save_checkpoint(make_model("LlamaForCausalLM"), tmp_path / "llama")
    url = env.upload(local, "models", "big-config")
    size = (local / "config.json").stat().st_size
    monkeypatch.setattr(object_store, "MAX_SMALL_FILE", size - 1)
    with pytest.raises(CheckpointError, match=r"config\.json: .*\[file-too-large\]"):
        fastload.from_pretrained(url, progress=False)


def test_a_malformed_config_is_named_by_its_url_not_a_temporary_path(env, tmp_path):
    pytest.importorskip("transformers")
    from tiny_models import make_model, save_checkpoint

    local = save_checkpoint(make_model("LlamaForCausalLM"), tmp_path / "llama")
    (local / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    url = env.upload(local, "models", "bad-config")
    with pytest.raises(CheckpointError) as caught:
        fastload.from_pretrained(url, progress=False)
    message = str(caught.value)
    assert f"{url}config.json" in message and "fastload-side-files" not in message, message
