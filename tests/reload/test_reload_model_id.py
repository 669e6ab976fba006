"""fastload.reload from a Hugging Face model id (issue 44, part 1: "local files, object storage
URLs and model ids, as a load takes them"), in a fresh interpreter that imports only what a user
imports, against a hub cache laid out on disk (tests/support/hf_cache.py) with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hf_cache import add_snapshot, directory_files

import fastload

pytest.importorskip("huggingface_hub")

REPO = "org/tiny-llama"


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """Two revisions of one model id: main (seed 1) and v2 (seed 2), each with digests."""
    pytest.importorskip("transformers")
    from tiny_models import make_checkpoint

    cache = tmp_path / "hub"
    for seed, revision in ((1, "main"), (2, "v2")):
        src = make_checkpoint(
            tmp_path / f"seed{seed}", "LlamaForCausalLM", seed=seed, max_shard_size="20KB"
        )
        add_snapshot(cache, REPO, directory_files(src), revision=revision)
    return cache


def _run(script: str, cache: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_revision_of_a_model_id_reloads_into_the_same_memory(cache: Path) -> None:
    got = _run(
        f"""
        import json, torch, fastload
        model = fastload.from_pretrained({REPO!r}, progress=False)
        before = {{n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}}
        report = fastload.reload(model, {REPO!r}, revision="v2")
        fresh = fastload.from_pretrained({REPO!r}, revision="v2", progress=False)
        after = {{n: t.data_ptr() for n, t in model.state_dict(keep_vars=True).items()}}
        new = fresh.state_dict()
        print(json.dumps({{
            "same_memory": before == after,
            "equal": all(torch.equal(t, new[n]) for n, t in model.state_dict().items()),
            "read": report.tensors_read,
            "files": report.files,
        }}))
        """,
        cache,
    )
    assert got["same_memory"] and got["equal"], got
    assert got["read"] > 0
    # the files of the v2 snapshot were read, not main's
    v2 = (cache / ("models--" + REPO.replace("/", "--")) / "refs" / "v2").read_text()
    assert got["files"] and all(f"/snapshots/{v2}/" in f for f in got["files"]), got


def test_an_unknown_model_id_is_refused_naming_it_and_nothing_is_written(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = fastload.from_pretrained(REPO, cache_dir=cache, progress=False)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(fastload.FastloadIOError, match="org/no-such-model"):
        fastload.reload(model, "org/no-such-model", cache_dir=cache)
    with pytest.raises(fastload.FastloadIOError, match="not found in the local cache"):
        fastload.reload(model, REPO, revision="v3", cache_dir=cache)
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_hub_options_with_a_url_or_a_state_dict_are_refused(cache: Path) -> None:
    pytest.importorskip("transformers")
    model = fastload.from_pretrained(REPO, cache_dir=cache, local_files_only=True, progress=False)
    with pytest.raises(fastload.RequestError, match="revision apply to a model id"):
        fastload.reload(model, "s3://bucket/model/", revision="v2")
    with pytest.raises(fastload.RequestError, match="subfolder apply to a model id.*state dict"):
        fastload.reload(model, model.state_dict(), subfolder="x")
