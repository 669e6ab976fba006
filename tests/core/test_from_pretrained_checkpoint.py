"""Resolving the checkpoint path of fastload.from_pretrained: one file, a directory, a sharded
index, and every way an index can be broken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file as st_save_file
from torch import nn

import fastload
from fastload import CheckpointError, FastloadIOError, PickleRefusedError
from fastload.core.checkpoint.files import resolve
from fastload.core.checkpoint.opened import open_checkpoint


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Pair().state_dict().items()}


def write_sharded(directory: Path, shards: dict[str, list[str]], index: dict | None = None) -> Path:
    """Writes the tensors of :func:`weights` into the named shard files, and an index listing
    them (or ``index`` as given)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = weights()
    weight_map = {}
    for shard, names in shards.items():
        st_save_file({n: tensors[n] for n in names}, directory / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, shard))
    data = index if index is not None else {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(data))
    return directory


SHARDS = {
    "model-00001-of-00002.safetensors": ["a.weight", "a.bias"],
    "model-00002-of-00002.safetensors": ["b.weight", "b.bias"],
}


def assert_loaded(model: nn.Module) -> None:
    for name, value in weights().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_single_safetensors_file_path_loads(tmp_path):
    st_save_file(weights(), tmp_path / "weights.safetensors")
    assert_loaded(fastload.from_pretrained(Pair, tmp_path / "weights.safetensors", progress=False))


def test_a_directory_with_model_safetensors_loads(tmp_path):
    st_save_file(weights(), tmp_path / "model.safetensors")
    assert_loaded(fastload.from_pretrained(Pair, tmp_path, progress=False))


def test_a_sharded_directory_loads_every_shard(tmp_path):
    path = write_sharded(tmp_path, SHARDS)
    model, report = fastload.from_pretrained(Pair, path, progress=False, output_loading_info=True)
    assert_loaded(model)
    assert len(report.files) == 2


def test_the_single_file_wins_over_an_index_in_the_same_directory(tmp_path):
    write_sharded(tmp_path, SHARDS)
    st_save_file(weights(seed=1), tmp_path / "model.safetensors")
    assert resolve(tmp_path).files == (tmp_path / "model.safetensors",)


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/tmp/absolute.safetensors", "sub/../../up.safetensors"],
)
def test_shard_names_escaping_the_directory_are_a_checkpoint_error(tmp_path, shard):
    index = {"weight_map": {"a.weight": shard}}
    path = write_sharded(tmp_path / "ckpt", SHARDS, index=index)
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        fastload.from_pretrained(Pair, path, progress=False)


def test_a_tensor_listed_twice_in_the_index_is_a_checkpoint_error(tmp_path):
    write_sharded(tmp_path, SHARDS)
    text = (
        '{"weight_map": {"a.weight": "model-00001-of-00002.safetensors", '
        '"a.weight": "model-00002-of-00002.safetensors"}}'
    )
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="'a.weight' is listed twice"):
        resolve(tmp_path)


def test_a_tensor_stored_in_two_shards_is_a_checkpoint_error(tmp_path):
    shards = {
        "model-00001-of-00002.safetensors": ["a.weight", "a.bias"],
        "model-00002-of-00002.safetensors": ["a.bias", "b.weight", "b.bias"],
    }
    write_sharded(tmp_path, shards)
    with pytest.raises(CheckpointError, match="'a.bias'"):
        fastload.from_pretrained(Pair, tmp_path, progress=False)


def test_a_missing_shard_is_a_checkpoint_error_naming_the_index_and_the_shard(tmp_path):
    write_sharded(tmp_path, SHARDS)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        fastload.from_pretrained(Pair, tmp_path, progress=False)
    assert "model.safetensors.index.json" in str(info.value)
    assert "model-00002-of-00002.safetensors" in str(info.value)


def test_an_index_listing_a_tensor_its_shard_lacks_is_a_checkpoint_error(tmp_path):
    write_sharded(tmp_path, SHARDS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["c.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'c.weight'"):
        open_checkpoint(resolve(tmp_path))


def test_a_shard_holding_a_tensor_the_index_puts_elsewhere_is_a_checkpoint_error(tmp_path):
    write_sharded(tmp_path, SHARDS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["a.bias"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'a.bias'"):
        open_checkpoint(resolve(tmp_path))


@pytest.mark.parametrize("text", ["{not json", '{"weights": {}}', '["a"]'])
def test_a_malformed_index_is_a_checkpoint_error(tmp_path, text):
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        resolve(tmp_path)


def test_a_directory_without_a_checkpoint_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors"):
        fastload.from_pretrained(Pair, tmp_path, progress=False)


def test_a_pickle_checkpoint_is_refused(tmp_path):
    torch.save(weights(), tmp_path / "pytorch_model.bin")
    with pytest.raises(PickleRefusedError):
        fastload.from_pretrained(Pair, tmp_path, progress=False)


def test_a_path_that_does_not_exist_is_an_io_error(tmp_path):
    with pytest.raises(FastloadIOError, match="nowhere"):
        fastload.from_pretrained(Pair, tmp_path / "nowhere", progress=False)


def test_a_corrupt_file_is_a_checkpoint_error_and_builds_nothing(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json}")
    built = []
    with pytest.raises(CheckpointError, match="model.safetensors"):
        fastload.from_pretrained(lambda: built.append(1) or Pair(), tmp_path, progress=False)
    assert built == []


def test_shard_names_with_dot_dot_that_stay_inside_the_directory_are_accepted(tmp_path):
    write_sharded(tmp_path, SHARDS)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {
        k: f"sub/../{v}" if k.startswith("a.") else v for k, v in index["weight_map"].items()
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "sub").mkdir()
    assert_loaded(fastload.from_pretrained(Pair, tmp_path, progress=False))
