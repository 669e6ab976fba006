"""The call shapes of from_pretrained, what the model looks like after a load, and the load
report that comes by default (missing tensors, no match, one shard of many)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import assert_same_tensors, make_checkpoint, model_class  # noqa: E402

import fastload  # noqa: E402
from fastload import CheckpointError, FastloadError, UnsupportedError, safe_open  # noqa: E402


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "BertForMaskedLM")


def load(*args, **kwargs):
    kwargs.setdefault("progress", False)
    return fastload.from_pretrained(*args, **kwargs)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "fastload" and r.levelno >= logging.WARNING
    ]


# --- call shapes -------------------------------------------------------------------------------


def test_a_path_alone_builds_the_class_named_by_architectures(bert):
    model = load(str(bert))
    assert type(model).__name__ == "BertForMaskedLM"
    assert_same_tensors(model, load(model_class("BertForMaskedLM"), bert))


def test_an_auto_class_is_resolved_through_the_config(bert):
    from transformers import AutoModel, AutoModelForMaskedLM

    assert type(load(AutoModelForMaskedLM, bert)).__name__ == "BertForMaskedLM"
    assert type(load(AutoModel, bert)).__name__ == "BertModel"


def test_an_auto_class_without_a_model_for_the_config_is_unsupported(bert):
    from transformers import AutoModelForSpeechSeq2Seq

    with pytest.raises(UnsupportedError, match="AutoModelForSpeechSeq2Seq"):
        load(AutoModelForSpeechSeq2Seq, bert)


def test_none_with_config_and_state_dict_builds_and_loads(bert):
    reference = load(str(bert))
    model = load(None, config=reference.config, state_dict=reference.state_dict())
    assert_same_tensors(model, reference)


def test_a_state_dict_without_a_config_is_a_request_error():
    with pytest.raises(fastload.RequestError, match="config"):
        load(None, state_dict={"w": torch.zeros(1)})


def test_architectures_naming_a_transformers_object_that_is_not_a_model_is_refused(tmp_path, bert):
    directory = tmp_path / "evil"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((bert / "model.safetensors").read_bytes())
    for name in ("GenerationConfig", "Trainer", "AutoTokenizer", "__class__"):
        config = json.loads((bert / "config.json").read_text())
        config["architectures"] = [name]
        (directory / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedError, match="not a transformers model class"):
            load(None, directory)


@pytest.mark.parametrize(
    "config_text",
    ["{not json", "[1, 2]", '{"architectures": "BertModel"}', '{"architectures": [3]}'],
)
def test_a_broken_config_json_raises_a_fastload_error(tmp_path, bert, config_text):
    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((bert / "model.safetensors").read_bytes())
    (directory / "config.json").write_text(config_text)
    with pytest.raises(FastloadError):
        load(None, directory)


def test_a_config_json_with_an_unknown_model_type_raises_a_fastload_error(tmp_path, bert):
    from transformers import AutoModel

    directory = tmp_path / "unknown"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((bert / "model.safetensors").read_bytes())
    (directory / "config.json").write_text(json.dumps({"model_type": "no-such-type"}))
    with pytest.raises(FastloadError):
        load(AutoModel, directory)


def test_a_config_json_the_model_cannot_be_built_from_is_a_checkpoint_error(tmp_path, bert):
    directory = tmp_path / "unbuildable"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((bert / "model.safetensors").read_bytes())
    config = json.loads((bert / "config.json").read_text())
    config["num_attention_heads"] = 5  # does not divide hidden_size 32
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="cannot be built"):
        load(None, directory)


def test_a_broken_generation_config_json_is_warned_and_the_model_still_loads(tmp_path, caplog):
    directory = make_checkpoint(tmp_path / "gpt2", "GPT2LMHeadModel")
    (directory / "generation_config.json").write_text("{not json")
    caplog.set_level(logging.WARNING, logger="fastload")
    model = load(str(directory))
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert any("generation_config.json" in m for m in warnings_of(caplog))


# --- after a load -------------------------------------------------------------------------------


def test_name_or_path_is_what_the_caller_passed(bert):
    assert load(str(bert)).name_or_path == str(bert)


def test_config_dtype_records_the_dtype_the_model_was_built_in(bert):
    assert load(str(bert), dtype=torch.bfloat16).config.dtype == torch.bfloat16


def test_a_built_model_is_in_eval_mode(bert):
    assert load(str(bert)).training is False


def test_a_module_passed_in_keeps_train_mode(bert):
    module = load(str(bert)).train()
    assert load(module, bert).training is True


def test_a_module_passed_in_keeps_eval_mode(bert):
    module = load(str(bert)).eval()
    assert load(module, bert).training is False


def test_a_device_map_over_one_device_sets_no_hf_device_map_as_transformers(bert):
    device_map = {"bert.embeddings": "cpu", "": "cpu"}
    theirs = model_class("BertModel").from_pretrained(str(bert), device_map=device_map)
    model = load(str(bert), device_map=device_map)
    assert not hasattr(theirs, "hf_device_map")
    assert not hasattr(model, "hf_device_map")


def test_a_load_without_device_map_sets_no_hf_device_map(bert):
    assert not hasattr(load(str(bert)), "hf_device_map")


# --- the load report ----------------------------------------------------------------------------


def test_missing_tensors_that_get_initialized_are_warned_by_default(bert, caplog):
    caplog.set_level(logging.WARNING, logger="fastload")
    load(model_class("BertForSequenceClassification"), bert)
    messages = warnings_of(caplog)
    assert any("classifier.weight" in m and "initialized" in m for m in messages)


def test_a_checkpoint_of_another_model_is_a_checkpoint_error(bert):
    with pytest.raises(CheckpointError, match="none of its"):
        load(model_class("GPT2Model"), bert)


def test_one_shard_passed_as_a_file_warns_that_its_index_is_beside_it(tmp_path, caplog):
    directory = make_checkpoint(tmp_path / "sharded", "BertModel", max_shard_size="20KB")
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 1
    caplog.set_level(logging.WARNING, logger="fastload")
    load(model_class("BertModel"), shards[0])
    assert any("model.safetensors.index.json" in m for m in warnings_of(caplog))


def test_a_file_that_its_one_shard_index_names_alone_has_no_index_warning(tmp_path, caplog):
    directory = make_checkpoint(tmp_path / "one", "BertModel")
    file = directory / "model.safetensors"
    with safe_open(file, "pt") as f:
        names = list(f.keys())
    weight_map = dict.fromkeys(names, file.name)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    caplog.set_level(logging.WARNING, logger="fastload")
    load(model_class("BertModel"), file)
    assert not any("index" in m for m in warnings_of(caplog))


def test_a_single_file_checkpoint_has_no_index_warning(bert, caplog):
    caplog.set_level(logging.WARNING, logger="fastload")
    load(model_class("BertForMaskedLM"), bert / "model.safetensors")
    assert not any("index" in m for m in warnings_of(caplog))
