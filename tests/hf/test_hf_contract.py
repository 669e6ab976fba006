"""Under the patch, transformers' observable contract rules (issue 25): loading-info types,
exception classes, messages on transformers' loggers, and what loads at all are transformers' own.
Each test compares with transformers unpatched where the behaviour is transformers' to define."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import make_checkpoint, make_model, model_class  # noqa: E402

import fastload  # noqa: E402
from fastload.core.basics.errors import CheckpointError, ModelMismatchError  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")


@pytest.fixture(scope="module")
def bert_mlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert_mlm"), "BertForMaskedLM")


@pytest.fixture(scope="module")
def bert_cls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert_cls"), "BertForSequenceClassification")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@contextmanager
def transformers_log() -> Iterator[_Lines]:
    """What transformers' loading logger says (it does not propagate to the root logger)."""
    log = logging.getLogger("transformers.modeling_utils")
    handler, level = _Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def both_ways(load: Any) -> tuple[Any, Any]:
    """``load()`` by transformers itself, then under the patch."""
    unpatched = load()
    with fastload.patch_transformers():
        patched = load()
    return unpatched, patched


def info_of(class_name: str, path: Path, **kwargs: Any) -> dict[str, Any]:
    _, info = model_class(class_name).from_pretrained(path, output_loading_info=True, **kwargs)
    return info


# A. loading info


def test_loading_info_under_the_patch_holds_sets_as_transformers_does(bert_mlm):
    expected, info = both_ways(lambda: info_of("BertForSequenceClassification", bert_mlm))
    assert {k: type(v) for k, v in info.items()} == {k: type(v) for k, v in expected.items()}
    assert info == expected
    assert isinstance(info["missing_keys"], set) and info["missing_keys"]


def test_the_load_report_as_a_dict_holds_sets_too(bert_mlm):
    _, report = fastload.from_pretrained(
        model_class("BertForSequenceClassification"),
        bert_mlm,
        progress=False,
        output_loading_info=True,
    )
    info = report.to_dict()
    assert isinstance(info["missing_keys"], set) and isinstance(info["mismatched_keys"], set)


# B. shape mismatches


def test_a_shape_mismatch_under_the_patch_raises_runtime_error_as_transformers_does(bert_cls):
    cls = model_class("BertForSequenceClassification")
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        cls.from_pretrained(bert_cls, num_labels=5)
    with (
        fastload.patch_transformers(),
        pytest.raises(RuntimeError, match="ignore_mismatched_sizes"),
    ):
        cls.from_pretrained(bert_cls, num_labels=5)


def test_ignoring_mismatched_sizes_under_the_patch_logs_reinit_on_transformers_logger(bert_cls):
    cls = model_class("BertForSequenceClassification")
    with fastload.patch_transformers(), transformers_log() as log:
        model, info = cls.from_pretrained(
            bert_cls, num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True
        )
    assert "Reinit due to size mismatch" in log.text
    assert info["mismatched_keys"] == {
        ("classifier.weight", (3, 32), (5, 32)),
        ("classifier.bias", (3,), (5,)),
    }
    assert model.classifier.weight.shape == (5, 32)


def test_a_shape_mismatch_in_the_direct_api_is_a_runtime_error_and_a_checkpoint_error(bert_cls):
    with pytest.raises(ModelMismatchError) as caught:
        fastload.from_pretrained(
            model_class("BertForSequenceClassification"), bert_cls, num_labels=5, progress=False
        )
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, CheckpointError)
    assert {m[0] for m in caught.value.mismatched} == {"classifier.weight", "classifier.bias"}


# C. what loads at all


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """A BERT directory whose weights file holds one tensor of no BERT model."""
    directory = make_checkpoint(tmp_path, "BertModel")
    fastload.save_file({"tensor": torch.tensor([1, 2])}, directory / "model.safetensors")
    return directory


def test_a_checkpoint_matching_nothing_loads_under_the_patch_with_every_key_missing(foreign):
    expected, info = both_ways(lambda: info_of("BertModel", foreign))
    assert info == expected
    assert "embeddings.word_embeddings.weight" in info["missing_keys"]
    assert info["unexpected_keys"] == {"tensor"}


def test_the_direct_api_still_refuses_a_checkpoint_matching_nothing(foreign):
    with pytest.raises(CheckpointError, match="none of its 1 tensors matches"):
        fastload.from_pretrained(model_class("BertModel"), foreign, progress=False)


def test_a_text_model_checkpoint_loads_into_the_full_clip_model_under_the_patch(tmp_path):
    from transformers import CLIPModel, CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=16,
    )
    CLIPTextModel(config).save_pretrained(tmp_path)
    expected, info = both_ways(
        lambda: CLIPModel.from_pretrained(tmp_path, output_loading_info=True)[1]
    )
    assert info == expected


# E. two checkpoint names for one model tensor


@pytest.fixture
def collision(tmp_path: Path) -> Path:
    """A BertForMaskedLM checkpoint that also holds ``embeddings.word_embeddings.weight`` (other
    values) beside ``bert.embeddings.word_embeddings.weight``: both are BertModel's one tensor."""
    directory = make_checkpoint(tmp_path, "BertForMaskedLM")
    tensors = dict(fastload.load_file(directory / "model.safetensors"))
    tensors["embeddings.word_embeddings.weight"] = torch.zeros_like(
        tensors["bert.embeddings.word_embeddings.weight"]
    )
    fastload.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_two_checkpoint_names_for_one_tensor_load_under_the_patch_as_transformers_does(
    collision,
):
    cls = model_class("BertModel")
    (expected, expected_info), (model, info) = both_ways(
        lambda: cls.from_pretrained(collision, output_loading_info=True)
    )
    weight = model.embeddings.word_embeddings.weight
    assert torch.equal(weight, expected.embeddings.word_embeddings.weight)
    assert weight.abs().sum() > 0  # the prefixed one, the first in transformers' order
    assert info == expected_info


def test_the_direct_api_still_refuses_two_checkpoint_names_for_one_tensor(collision):
    with pytest.raises(CheckpointError, match="both map to model tensor"):
        fastload.from_pretrained(model_class("BertModel"), collision, progress=False)


# I. messages on transformers' loggers


def test_unexpected_keys_under_the_patch_are_reported_on_transformers_logger(bert_mlm, tmp_path):
    tensors = dict(fastload.load_file(bert_mlm / "model.safetensors"))
    tensors["added_key"] = torch.zeros(2)
    for name in ("config.json", "generation_config.json"):
        if (bert_mlm / name).exists():
            (tmp_path / name).write_bytes((bert_mlm / name).read_bytes())
    fastload.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with fastload.patch_transformers(), transformers_log() as log:
        model_class("BertForMaskedLM").from_pretrained(tmp_path)
    assert "added_key | UNEXPECTED" in log.text


def test_a_tied_pair_absent_from_the_checkpoint_under_the_patch_warns_as_transformers_does(
    tmp_path,
):
    model = make_model("GPT2LMHeadModel")
    model.save_pretrained(tmp_path)
    tensors = dict(fastload.load_file(tmp_path / "model.safetensors"))
    tensors.pop("transformer.wte.weight")
    tensors.pop("lm_head.weight", None)
    fastload.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cls = model_class("GPT2LMHeadModel")
    with transformers_log() as expected_log:
        _, expected = cls.from_pretrained(tmp_path, output_loading_info=True)
    with fastload.patch_transformers(), transformers_log() as log:
        loaded, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert "This checkpoint seem corrupted" in expected_log.text
    assert "This checkpoint seem corrupted" in log.text
    assert info["missing_keys"] == expected["missing_keys"]
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


# Also: tp_plan in a single process


def test_tp_plan_in_a_single_process_under_the_patch_loads_as_transformers_does(tmp_path):
    directory = make_checkpoint(tmp_path, "LlamaForCausalLM")
    cls = model_class("LlamaForCausalLM")
    expected, loaded = both_ways(lambda: cls.from_pretrained(directory, tp_plan="auto"))
    assert type(loaded) is type(expected)
    want = expected.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
