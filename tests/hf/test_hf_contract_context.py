"""transformers' contract beyond the call's arguments (issue 25, causes D, F, G, H): the ambient
device, transformers' environment variables, its conversion operations as they are at run time,
and quantization configs. Under the patch each behaves as transformers' own ``from_pretrained``;
the direct API stays device-explicit and refuses what it cannot serve identically, by name."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import assert_same_tensors, make_checkpoint, make_model  # noqa: E402

import fastload  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bert"), "BertModel")


def with_quantization_config(directory: Path, quantization: dict) -> Path:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization
    path.write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny MoE checkpoint, saved one tensor per expert (merged by transformers' conversions)."""
    from transformers import MixtralConfig, MixtralModel

    config = MixtralConfig(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        vocab_size=99,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("mixtral")
    MixtralModel(config).save_pretrained(directory)
    return directory


# D. The ambient device


def test_under_the_patch_a_meta_device_context_raises_transformers_runtime_error(bert):
    from transformers import BertModel

    fastload.patch_transformers()
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta device context manager"):
        BertModel.from_pretrained(bert)


def test_the_direct_api_under_a_meta_device_context_loads_onto_its_device_argument(bert):
    with torch.device("meta"):
        model = fastload.from_pretrained(bert)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}
    assert_same_tensors(model, make_model("BertModel"))


def test_a_default_device_set_to_meta_does_not_leak_into_a_direct_load(bert):
    torch.set_default_device("meta")
    try:
        model = fastload.from_pretrained(bert)
    finally:
        torch.set_default_device(None)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


# F. transformers' environment variables


def test_under_the_patch_hf_deactivate_async_load_starts_no_thread(bert, monkeypatch):
    from transformers import BertModel

    fastload.patch_transformers()
    BertModel.from_pretrained(bert)  # anything started once per process is started now
    started: list[str] = []
    original = threading.Thread.__init__

    def counting(self, *args, **kwargs):
        started.append(kwargs.get("name") or "?")
        original(self, *args, **kwargs)

    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    monkeypatch.setattr(threading.Thread, "__init__", counting)
    BertModel.from_pretrained(bert)
    assert started == []


# G. Conversions as they are at run time


def test_under_the_patch_an_error_in_a_conversion_operation_surfaces_as_transformers_does(
    mixtral,
):
    from transformers import MixtralModel
    from transformers.core_model_loading import MergeModulelist

    fastload.patch_transformers()
    with (
        mock.patch.object(MergeModulelist, "convert", side_effect=Exception("failed")),
        pytest.raises(RuntimeError, match="issues during automatic conversion of the weights"),
    ):
        MixtralModel.from_pretrained(mixtral)


def test_the_direct_api_refuses_a_replaced_conversion_operation_by_name(mixtral):
    from transformers import MixtralModel
    from transformers.core_model_loading import MergeModulelist

    with (
        mock.patch.object(MergeModulelist, "convert", side_effect=Exception("failed")),
        pytest.raises(fastload.UnsupportedError, match="MergeModulelist"),
    ):
        fastload.from_pretrained(MixtralModel, mixtral)


# H. Quantization configs


def test_under_the_patch_a_quantization_config_goes_to_transformers_loader(
    tmp_path, caplog, transformers_loads
):
    from transformers import BertModel

    directory = with_quantization_config(
        make_checkpoint(tmp_path, "BertModel"), {"quant_method": "unknown"}
    )
    fastload.patch_transformers()
    with caplog.at_level(logging.WARNING):
        BertModel.from_pretrained(directory)
    assert transformers_loads == ["BertModel"]
    words = [r.getMessage() for r in caplog.records]
    assert any(w.startswith("Unknown quantization type") for w in words)  # transformers' own
    assert sum("left to transformers" in w and "quantization_config" in w for w in words) == 1


@pytest.mark.parametrize(
    "quantization",
    [
        # fp8, mxfp4 (dequantized) and bitsandbytes are served on the CPU now
        # (tests/hf/test_hf_fp8_dequantize.py, test_hf_mxfp4_dequantize.py,
        # test_hf_bitsandbytes.py); and GPTQ, AWQ (tests/hf/test_hf_gptq_awq.py); HQQ and EETQ are
        # methods fastload does not read
        {"quant_method": "hqq", "nbits": 4},
        {"quant_method": "eetq", "weights": "int8"},
        {"quant_method": "unknown"},
    ],
    ids=["hqq", "eetq", "unknown"],
)
def test_the_direct_api_refuses_a_checkpoint_with_a_quantization_config(tmp_path, quantization):
    directory = with_quantization_config(make_checkpoint(tmp_path, "BertModel"), quantization)
    method = quantization["quant_method"]
    with pytest.raises(fastload.UnsupportedError, match=f"quant_method='{method}'"):
        fastload.from_pretrained(directory)
