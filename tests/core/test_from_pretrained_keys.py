"""Key mapping and key policies of fastload.from_pretrained.

Base-model prefix added and stripped (BertModel <-> BertForMaskedLM), legacy gamma/beta names, the
caller's key_map, the missing / unexpected / mismatch policies, and the names a model class
declares as expected (transformers #7272).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

import fastload
from fastload import CheckpointError, RequestError

transformers = pytest.importorskip("transformers")

from tiny_models import (  # noqa: E402
    assert_same_tensors,
    make_checkpoint,
    make_config,
    model_class,
)

BertModel = model_class("BertModel")
BertForMaskedLM = model_class("BertForMaskedLM")


@pytest.fixture(scope="module")
def bert_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert-base"), "BertModel", seed=1)


@pytest.fixture(scope="module")
def bert_mlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert-mlm"), "BertForMaskedLM", seed=2)


def load(cls, path, **kwargs):
    return fastload.from_pretrained(cls, path, progress=False, output_loading_info=True, **kwargs)


def rewrite(src: Path, dst: Path, change) -> Path:
    """Copies checkpoint ``src`` to ``dst`` (config included) with its tensors passed through
    ``change(dict) -> dict``."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = change(dict(st_load_file(src / "model.safetensors")))
    st_save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def fastload_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fastload" and r.levelno >= logging.WARNING
    ]


# --- prefix ----------------------------------------------------------------------------------


def test_bert_model_checkpoint_loads_into_masked_lm_with_pooler_authorized(bert_base, caplog):
    caplog.set_level(logging.INFO, logger="fastload")
    model, report = load(BertForMaskedLM, bert_base)
    base = BertModel.from_pretrained(bert_base)
    for name, param in base.named_parameters():
        if not name.startswith("pooler."):
            assert torch.equal(model.get_parameter(f"bert.{name}"), param), name
    assert sorted(report.authorized_unexpected) == ["pooler.dense.bias", "pooler.dense.weight"]
    assert report.unexpected == []
    # the head the checkpoint lacks is reported (initialized); the pooler is not
    assert not any("pooler" in m for m in fastload_warnings(caplog))
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias


def test_bert_model_checkpoint_in_masked_lm_matches_transformers_on_loaded_weights(bert_base):
    model, report = load(BertForMaskedLM, bert_base)
    theirs = BertForMaskedLM.from_pretrained(bert_base)
    initialized = set(report.initialized)
    assert initialized == {
        "cls.predictions.bias",
        "cls.predictions.decoder.bias",
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
    }
    for name, param in theirs.named_parameters():
        if name not in initialized:
            assert torch.equal(model.get_parameter(name), param), name


def test_masked_lm_checkpoint_loads_into_bert_model_stripping_the_prefix(bert_mlm, caplog):
    model, report = load(BertModel, bert_mlm)
    theirs = BertForMaskedLM.from_pretrained(bert_mlm)
    for name, param in model.named_parameters():
        if not name.startswith("pooler."):
            assert torch.equal(param, theirs.get_parameter(f"bert.{name}")), name
    assert report.renamed["bert.embeddings.word_embeddings.weight"] == (
        "embeddings.word_embeddings.weight"
    )
    assert sorted(report.unexpected) == sorted(
        [
            "cls.predictions.bias",
            "cls.predictions.transform.LayerNorm.bias",
            "cls.predictions.transform.LayerNorm.weight",
            "cls.predictions.transform.dense.bias",
            "cls.predictions.transform.dense.weight",
        ]
    )
    assert report.missing == ["pooler.dense.weight", "pooler.dense.bias"]
    assert any("cls.predictions.bias" in m for m in fastload_warnings(caplog))


def test_t5_model_checkpoint_loads_into_encoder_model_with_decoder_authorized(tmp_path, caplog):
    path = make_checkpoint(tmp_path, "T5Model")
    model, report = load(model_class("T5EncoderModel"), path, unexpected="error")
    assert report.unexpected == []
    assert report.authorized_unexpected and all(
        n.startswith("decoder.") for n in report.authorized_unexpected
    )
    assert model.encoder.embed_tokens.weight is model.shared.weight


# --- legacy names and key_map -----------------------------------------------------------------


def test_legacy_gamma_and_beta_names_load_into_weight_and_bias(bert_base, tmp_path):
    def legacy(tensors):
        return {
            k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
                "LayerNorm.bias", "LayerNorm.beta"
            ): v
            for k, v in tensors.items()
        }

    path = rewrite(bert_base, tmp_path / "legacy", legacy)
    model, report = load(BertModel, path, unexpected="error", missing="error")
    assert_same_tensors(model, BertModel.from_pretrained(bert_base))
    assert report.renamed["embeddings.LayerNorm.gamma"] == "embeddings.LayerNorm.weight"


def test_key_map_of_regular_expressions_renames_checkpoint_names(bert_base, tmp_path):
    path = rewrite(
        bert_base,
        tmp_path / "renamed",
        lambda t: {k.replace("encoder.layer.", "blocks."): v for k, v in t.items()},
    )
    model, _ = load(BertModel, path, key_map={r"^blocks\.": "encoder.layer."}, strict=True)
    assert_same_tensors(model, BertModel.from_pretrained(bert_base))


def test_key_map_callable_renames_checkpoint_names(bert_base, tmp_path):
    path = rewrite(bert_base, tmp_path / "upper", lambda t: {k.upper(): v for k, v in t.items()})
    names = {k.upper(): k for k in st_load_file(bert_base / "model.safetensors")}
    model, _ = load(BertModel, path, key_map=names.__getitem__, strict=True)
    assert_same_tensors(model, BertModel.from_pretrained(bert_base))


def test_key_map_callable_returning_a_non_string_is_a_request_error(bert_base):
    with pytest.raises(RequestError, match="must return a str"):
        load(BertModel, bert_base, key_map=lambda name: None)


def test_two_checkpoint_tensors_mapping_to_one_model_tensor_is_an_error(bert_base, tmp_path):
    def both(tensors):
        tensors["bert.pooler.dense.bias"] = tensors["pooler.dense.bias"].clone()
        return tensors

    path = rewrite(bert_base, tmp_path / "both", both)
    with pytest.raises(CheckpointError, match="pooler.dense.bias.*both map"):
        load(BertModel, path)


# --- missing ---------------------------------------------------------------------------------


def test_missing_error_raises_naming_the_missing_tensors(bert_base, tmp_path):
    path = rewrite(
        bert_base,
        tmp_path / "nopooler",
        lambda t: {k: v for k, v in t.items() if "pooler" not in k},
    )
    with pytest.raises(CheckpointError, match="pooler.dense.weight"):
        load(BertModel, path, missing="error")


def test_missing_warn_logs_the_names_and_initializes(bert_base, tmp_path, caplog):
    path = rewrite(
        bert_base,
        tmp_path / "nopooler",
        lambda t: {k: v for k, v in t.items() if "pooler" not in k},
    )
    model, report = load(BertModel, path, missing="warn")
    assert any("pooler.dense.weight" in m for m in fastload_warnings(caplog))
    assert report.missing == ["pooler.dense.weight", "pooler.dense.bias"]
    assert torch.isfinite(model.pooler.dense.weight).all()


def test_missing_init_is_silent_and_uses_the_models_own_initialization(bert_base, caplog):
    model, report = load(BertForMaskedLM, bert_base, missing="init")
    assert fastload_warnings(caplog) == []
    head = model.cls.predictions
    # BertPreTrainedModel._init_weights: LayerNorm ones/zeros, prediction bias zeros,
    # Linear weights normal(0, initializer_range) with zero bias.
    assert torch.equal(head.transform.LayerNorm.weight, torch.ones(32))
    assert torch.equal(head.transform.LayerNorm.bias, torch.zeros(32))
    assert torch.equal(head.bias, torch.zeros(99))
    assert torch.equal(head.transform.dense.bias, torch.zeros(32))
    std = head.transform.dense.weight.std().item()
    assert 0.5 * model.config.initializer_range < std < 1.5 * model.config.initializer_range


def test_missing_tensors_declared_by_the_class_are_authorized(tmp_path):
    # BartForConditionalGeneration lists final_logits_bias in _keys_to_ignore_on_load_missing.
    src = make_checkpoint(tmp_path / "bart", "BartForConditionalGeneration")
    path = rewrite(
        src,
        tmp_path / "nobias",
        lambda t: {k: v for k, v in t.items() if k != "final_logits_bias"},
    )
    model, report = load(model_class("BartForConditionalGeneration"), path, missing="error")
    assert report.authorized_missing == ["final_logits_bias"]
    assert report.missing == []
    assert torch.equal(model.final_logits_bias, torch.zeros(1, 99))


# --- unexpected ------------------------------------------------------------------------------


def test_unexpected_error_raises_naming_the_unused_tensors(bert_mlm):
    with pytest.raises(CheckpointError, match="cls.predictions.transform.dense.weight"):
        load(BertModel, bert_mlm, unexpected="error")


def test_unexpected_ignore_is_silent(bert_mlm, caplog):
    _, report = load(BertModel, bert_mlm, unexpected="ignore")
    assert len(report.unexpected) == 5
    assert not any("not used" in m for m in fastload_warnings(caplog))


def test_old_persistent_position_ids_in_a_checkpoint_are_authorized(bert_base, tmp_path):
    def old(tensors):
        tensors["embeddings.position_ids"] = torch.arange(7).expand(1, -1).contiguous()
        return tensors

    path = rewrite(bert_base, tmp_path / "old", old)
    model, report = load(BertModel, path, unexpected="error")
    assert report.authorized_unexpected == ["embeddings.position_ids"]
    assert torch.equal(model.embeddings.position_ids, torch.arange(64).expand(1, -1))


def test_unexpected_tensors_declared_by_the_class_are_authorized(tmp_path):
    # GPT2 lists "attn.bias" (the causal mask old checkpoints stored) as expected.
    src = make_checkpoint(tmp_path / "gpt2", "GPT2Model")

    def old(tensors):
        tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
        return tensors

    path = rewrite(src, tmp_path / "old", old)
    _, report = load(model_class("GPT2Model"), path, unexpected="error")
    assert report.authorized_unexpected == ["h.0.attn.bias"]


# --- strict ----------------------------------------------------------------------------------


def test_strict_turns_missing_into_an_error_even_with_init(bert_base):
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        load(BertForMaskedLM, bert_base, strict=True, missing="init")


def test_strict_turns_unexpected_into_an_error_even_with_ignore(bert_mlm):
    with pytest.raises(CheckpointError, match="no place in the model"):
        load(BertModel, bert_mlm, strict=True, unexpected="ignore")


def test_strict_still_accepts_authorized_names(tmp_path):
    config = make_config("bert")
    src = make_checkpoint(tmp_path / "src", "BertModel")
    model, report = load(BertModel(config, add_pooling_layer=False).to("meta"), src, strict=True)
    assert model.pooler is None
    assert report.authorized_unexpected == ["pooler.dense.bias", "pooler.dense.weight"]


@pytest.mark.parametrize("option", ["missing", "unexpected"])
def test_unknown_policy_value_is_a_request_error(bert_base, option):
    with pytest.raises(RequestError, match=option):
        load(BertModel, bert_base, **{option: "sometimes"})


# --- mismatched shapes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("cls3"), "BertForSequenceClassification", num_labels=3
    )


def test_shape_mismatch_is_an_error_naming_the_key_and_both_shapes(classifier_3):
    cls = model_class("BertForSequenceClassification")
    with pytest.raises(CheckpointError) as info:
        load(cls, classifier_3, config=make_config("bert", num_labels=5))
    message = str(info.value)
    assert "classifier.weight" in message
    assert "[3, 32]" in message and "[5, 32]" in message


def test_ignore_mismatched_sizes_reinitializes_the_mismatched_tensors(classifier_3):
    cls = model_class("BertForSequenceClassification")
    model, report = load(
        cls,
        classifier_3,
        config=make_config("bert", num_labels=5),
        ignore_mismatched_sizes=True,
        missing="error",
    )
    assert ("classifier.weight", (3, 32), (5, 32)) in report.mismatched
    assert ("classifier.bias", (3,), (5,)) in report.mismatched
    assert report.missing == []
    assert model.classifier.weight.shape == (5, 32)
    assert torch.equal(model.classifier.bias, torch.zeros(5))
    theirs = cls.from_pretrained(classifier_3)
    assert torch.equal(model.bert.pooler.dense.weight, theirs.bert.pooler.dense.weight)
