"""compressed-tensors checkpoints with ``dequantize: true`` (``quant_method:
compressed-tensors``), which transformers dequantizes on load into its dense model
(``CompressedTensorsDequantize``: compressed-tensors' own decompressor on each module's stored
tensors): fastload reads them, runs transformers' operation on them
(:mod:`fastload.hf.load_ops`) and the model is transformers' own, bitwise. The checkpoints are
the tiny Llamas of tests/hf/test_hf_quantized.py (compressed-tensors' own code: int8, int4 packed,
FP8, NVFP4, MXFP4), their config asking to dequantize."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantized_checkpoints import (  # noqa: E402
    COMPRESSED_TENSORS_FORMATS,
    assert_same_model,
    assert_saves_alike,
    compressed_tensors_checkpoint,
    conversions,
    operation_order,
    patched_and_transformers,
    rewritten,
)

import fastload  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")

PROJ = "model.layers.1.mlp.down_proj"


def _dequantized(directory: Path) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["dequantize"] = True
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(
    scope="module",
    params=COMPRESSED_TENSORS_FORMATS,
    ids=[f[0] for f in COMPRESSED_TENSORS_FORMATS],
)
def dequantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, scheme, form = request.param
    return _dequantized(compressed_tensors_checkpoint(tmp_path_factory.mktemp(name), scheme, form))


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    logging.getLogger("compressed_tensors").setLevel(logging.ERROR)
    yield
    logging.getLogger("compressed_tensors").setLevel(logging.NOTSET)


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


@pytest.mark.parametrize(
    ("read_mode", "dtype"), [("pread", None), ("mmap", None), ("mmap", torch.float32)]
)
def test_a_checkpoint_to_dequantize_loads_as_transformers_dequantizes_it(
    dequantized: Path, read_mode: str, dtype: torch.dtype | None
) -> None:
    options = {} if dtype is None else {"dtype": dtype}
    want = _transformers(dequantized, **options)
    got, report = fastload.from_pretrained(
        dequantized, read_mode=read_mode, output_loading_info=True, **options
    )
    assert report.quant_method == "compressed-tensors" and report.quant_seconds > 0
    assert not report.missing and not report.unexpected and not report.mismatched
    assert not report.authorized_unexpected  # every scale (and packed shape) was used
    proj = got.model.layers[0].mlp.up_proj
    assert type(proj) is torch.nn.Linear and proj.weight.dtype == (dtype or torch.bfloat16)
    assert_same_model(got, want)


def test_the_operations_run_in_the_order_of_the_file_one_at_a_time(
    dequantized: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations.compressed_tensors import CompressedTensorsDequantize

    done = operation_order(dequantized, CompressedTensorsDequantize, monkeypatch)
    assert len(done) == 14  # 7 projections of 2 layers
    for names, target in done:
        module = target.removesuffix(".weight")
        assert all(n.startswith(module + ".weight") for n in names) and len(names) >= 2


def test_under_the_patch_a_checkpoint_to_dequantize_is_read_by_fastload(
    dequantized: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(dequantized, "compressed-tensors", transformers_loads)
    assert_same_model(got, want)


def test_save_pretrained_writes_what_it_writes_of_transformers_model(
    dequantized: Path, tmp_path: Path
) -> None:
    """A dequantized model saves as transformers' does: dense weights, no quantization config."""
    got = fastload.from_pretrained(dequantized)
    assert_saves_alike(got, _transformers(dequantized), tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "fastload/config.json").read_text())


@pytest.fixture
def no_operation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from transformers.integrations.compressed_tensors import CompressedTensorsDequantize

    return conversions(CompressedTensorsDequantize, monkeypatch)


def _quantized_name(tensors: dict[str, torch.Tensor]) -> str:
    return f"{PROJ}.weight_packed" if f"{PROJ}.weight_packed" in tensors else f"{PROJ}.weight"


def test_a_missing_scale_is_refused_naming_it_before_reading(
    dequantized: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    directory = rewritten(dequantized, tmp_path, lambda t: t.pop(f"{PROJ}.weight_scale"))
    with pytest.raises(
        fastload.CheckpointError, match=rf"but its scale '{PROJ}\.weight_scale' is missing"
    ):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_a_scale_of_the_wrong_shape_is_refused_naming_it_before_reading(
    dequantized: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    name = f"{PROJ}.weight_scale"

    def narrow(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:7].contiguous()

    directory = rewritten(dequantized, tmp_path, narrow)
    with pytest.raises(
        fastload.ModelMismatchError, match=rf"tensor '{name}' has shape \[7, \d+\]; the \w+ scale"
    ):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_a_quantized_weight_of_the_wrong_size_is_refused_naming_it_before_reading(
    dequantized: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    """A weight (or packed weight) whose size does not match the model's [out, in] and the
    config group's bits."""
    named: list[str] = []

    def narrow(tensors: dict[str, torch.Tensor]) -> None:
        named.append(_quantized_name(tensors))
        tensors[named[0]] = tensors[named[0]][:, :3].contiguous()

    directory = rewritten(dequantized, tmp_path, narrow)
    with pytest.raises(
        fastload.ModelMismatchError, match=rf"tensor '{named[0]}' has shape \[64, 3\]"
    ):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_a_packed_weight_without_its_shape_is_refused_naming_it(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, no_operation: list[str]
) -> None:
    name, scheme, form = COMPRESSED_TENSORS_FORMATS[1]
    assert form == "pack-quantized"
    source = _dequantized(
        compressed_tensors_checkpoint(tmp_path_factory.mktemp(name), scheme, form)
    )
    directory = rewritten(source, tmp_path, lambda t: t.pop(f"{PROJ}.weight_shape"))
    with pytest.raises(
        fastload.CheckpointError,
        match=rf"'{PROJ}\.weight_packed' is packed but its '{PROJ}\.weight_shape'",
    ):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_an_asymmetric_scheme_without_its_zero_point_is_refused_naming_it(
    dequantized: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    """The config group says asymmetric (a zero point per scale) and the checkpoint has none."""
    directory = rewritten(dequantized, tmp_path, lambda t: None)
    config = json.loads((directory / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["weights"]["symmetric"] = False
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        fastload.CheckpointError,
        match=r"is quantized asymmetrically \(its config group\) but its zero point "
        r"'model\.layers\.\d\.\w+\.\w+_proj\.weight_zero_point' is missing",
    ):
        fastload.from_pretrained(directory)
    assert no_operation == []
