"""gpt-oss' MXFP4 checkpoints (``quant_method: mxfp4``, the experts' ``<proj>_blocks`` and
``<proj>_scales``) on a machine without a GPU, where transformers dequantizes them on load
(``Mxfp4Dequantize``): fastload reads the packed values and exponents, runs transformers' own
operation on them (:mod:`fastload.hf.load_ops`) and the model is transformers' own, bitwise.
The checkpoint is written as gpt-oss stores one (:mod:`quantized_checkpoints`: transformers'
MXFP4 quantizer needs the hub's Triton kernels to quantize)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gpt_oss")

import quantized_checkpoints  # noqa: E402
from quantized_checkpoints import (  # noqa: E402
    assert_same_model,
    assert_saves_alike,
    conversions,
    operation_order,
    patched_and_transformers,
    rewritten,
)

import fastload  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("unpatched"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="transformers keeps MXFP4 on a GPU"),
]

EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_checkpoints.mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4"))


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


@pytest.mark.parametrize(
    ("read_mode", "dtype"), [("pread", None), ("mmap", None), ("mmap", torch.float32)]
)
def test_an_mxfp4_checkpoint_dequantized_on_load_is_transformers_model(
    mxfp4_checkpoint: Path, read_mode: str, dtype: torch.dtype | None
) -> None:
    """Dequantized into the model's dtype (the checkpoint's bf16, or the one asked for)."""
    options = {} if dtype is None else {"dtype": dtype}
    want = _transformers(mxfp4_checkpoint, **options)
    got, report = fastload.from_pretrained(
        mxfp4_checkpoint, read_mode=read_mode, output_loading_info=True, **options
    )
    assert report.quant_method == "mxfp4" and report.quant_seconds > 0
    assert "quantized: mxfp4" in report.summary()
    assert not report.missing and not report.unexpected and not report.mismatched
    assert not report.authorized_unexpected  # every block and scale was used
    experts = got.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts"  # transformers' own, not its MXFP4 module
    assert experts.gate_up_proj.dtype == (dtype or torch.bfloat16)
    assert_same_model(got, want)


def test_the_operations_run_in_the_order_of_the_file_one_at_a_time(
    mxfp4_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    done = operation_order(mxfp4_checkpoint, Mxfp4Dequantize, monkeypatch)
    assert len(done) == 4  # gate_up_proj and down_proj of 2 layers
    for names, target in done:
        assert sorted(names) == sorted([target + "_blocks", target + "_scales"])


def test_under_the_patch_an_mxfp4_checkpoint_is_read_by_fastload(
    mxfp4_checkpoint: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(mxfp4_checkpoint, "mxfp4", transformers_loads)
    assert_same_model(got, want)


def test_save_pretrained_writes_what_it_writes_of_transformers_model(
    mxfp4_checkpoint: Path, tmp_path: Path
) -> None:
    """A dequantized model saves as transformers' does: bf16 experts, no quantization config."""
    got = fastload.from_pretrained(mxfp4_checkpoint)
    assert_saves_alike(got, _transformers(mxfp4_checkpoint), tmp_path)
    saved = json.loads((tmp_path / "fastload" / "config.json").read_text())
    assert "quantization_config" not in saved


@pytest.fixture
def no_operation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The targets transformers' dequantize ran for (none, where the plan refuses)."""
    from transformers.integrations.mxfp4 import Mxfp4Dequantize

    return conversions(Mxfp4Dequantize, monkeypatch)


def _shape(name: str, slices: tuple[slice, ...]):  # type: ignore[no-untyped-def]
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][slices].contiguous()

    return change


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        pytest.param(
            lambda t: t.pop(f"{EXPERTS}.down_proj_scales"),
            fastload.CheckpointError,
            rf"'{EXPERTS}.down_proj_blocks' is quantized \(U8\) but its scale "
            rf"'{EXPERTS}.down_proj_scales' is missing",
            id="scales-missing",
        ),
        pytest.param(
            lambda t: t.pop(f"{EXPERTS}.gate_up_proj_blocks"),
            fastload.CheckpointError,
            rf"'{EXPERTS}.gate_up_proj_scales' has no 'gate_up_proj_blocks' beside it",
            id="blocks-missing",
        ),
        pytest.param(
            _shape(f"{EXPERTS}.down_proj_scales", (slice(None), slice(None), slice(0, 1))),
            fastload.ModelMismatchError,
            rf"'{EXPERTS}.down_proj_scales' has shape \[4, 64, 1\].* as \[4, 64, 2\]",
            id="scales-shape",
        ),
        pytest.param(
            _shape(f"{EXPERTS}.gate_up_proj_blocks", (slice(None), slice(0, 64))),
            fastload.ModelMismatchError,
            rf"'{EXPERTS}.gate_up_proj_blocks' has shape \[4, 64, 2, 16\].* as \[4, 128, 2, 16\]",
            id="blocks-rows",
        ),
        pytest.param(
            _shape(f"{EXPERTS}.down_proj_blocks", (Ellipsis, slice(0, 8))),
            fastload.ModelMismatchError,
            rf"'{EXPERTS}.down_proj_blocks' has shape \[4, 64, 2, 8\].* as \[4, 64, 2, 16\]",
            id="blocks-packed-size",
        ),
        pytest.param(
            lambda t: t.__setitem__(
                f"{EXPERTS}.down_proj_scales", t[f"{EXPERTS}.down_proj_scales"].float()
            ),
            fastload.CheckpointError,
            rf"'{EXPERTS}.down_proj_scales' has dtype F32; MXFP4 exponents are stored as U8",
            id="scales-dtype",
        ),
        pytest.param(
            lambda t: t.__setitem__(
                f"{EXPERTS}.down_proj_blocks", t[f"{EXPERTS}.down_proj_blocks"].to(torch.int16)
            ),
            fastload.CheckpointError,
            rf"'{EXPERTS}.down_proj_blocks' has dtype I16; MXFP4 packed values are stored as U8",
            id="blocks-dtype",
        ),
    ],
)
def test_bad_blocks_or_scales_are_refused_naming_them_before_reading(
    mxfp4_checkpoint: Path,
    tmp_path: Path,
    no_operation: list[str],
    change,  # type: ignore[no-untyped-def]
    error: type[Exception],
    message: str,
) -> None:
    directory = rewritten(mxfp4_checkpoint, tmp_path, change)
    with pytest.raises(error, match=message):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_a_wrong_shape_is_the_error_class_transformers_raises(
    mxfp4_checkpoint: Path, tmp_path: Path
) -> None:
    """transformers raises ``RuntimeError`` for blocks or scales of the wrong shape;
    ``ModelMismatchError`` is one."""
    change = _shape(f"{EXPERTS}.down_proj_scales", (slice(None), slice(None), slice(0, 1)))
    directory = rewritten(mxfp4_checkpoint, tmp_path, change)
    with pytest.raises(RuntimeError) as theirs:
        _transformers(directory)
    with pytest.raises(type(theirs.value)):
        fastload.from_pretrained(directory)


def test_mxfp4_kept_packed_is_still_refused(mxfp4_checkpoint: Path) -> None:
    """A quantizer that does not dequantize (a GPU, or the hub's Triton kernels on the CPU)
    deserializes into its own MXFP4 modules, which fastload does not read: refused by name."""
    from transformers.quantizers import quantizer_mxfp4

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantizer_mxfp4.Mxfp4HfQuantizer, "validate_environment", lambda *a, **k: None)
        with pytest.raises(
            fastload.UnsupportedError,
            match=r"quant_method='mxfp4'.*Mxfp4Deserialize \(deserialize\)",
        ):
            fastload.from_pretrained(mxfp4_checkpoint)


def test_dequantize_true_in_the_config_is_served_where_the_kernels_would_run(
    mxfp4_checkpoint: Path, tmp_path: Path
) -> None:
    """``dequantize: true`` asks transformers to dequantize whatever the machine (its
    environment check, made a no-op here as where the kernels run, is not what decides)."""
    from transformers.quantizers import quantizer_mxfp4

    directory = rewritten(mxfp4_checkpoint, tmp_path, lambda t: None)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["dequantize"] = True
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantizer_mxfp4.Mxfp4HfQuantizer, "validate_environment", lambda *a, **k: None)
        got, report = fastload.from_pretrained(directory, output_loading_info=True)
        want = _transformers(directory)
    assert report.quant_method == "mxfp4"
    assert_same_model(got, want)


def test_a_model_made_by_a_load_operation_is_not_reloaded(mxfp4_checkpoint: Path) -> None:
    model = fastload.from_pretrained(mxfp4_checkpoint)
    with pytest.raises(fastload.UnsupportedError, match="load operation"):
        fastload.reload(model, mxfp4_checkpoint)
