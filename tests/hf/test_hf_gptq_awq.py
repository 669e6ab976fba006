"""GPTQ and AWQ pre-quantized checkpoints (``quant_method: gptq`` / ``awq``, 4 bits, groups of
128) on the CPU, which transformers 5 loads through gptqmodel's CPU kernels (``TorchAtenLinear`` or,
where its AVX-512 extension builds, ``TorchCpuAvx512Linear``, and their AWQ twins; GPTQ also
through optimum's ``GPTQQuantizer``). Both are stored as they
run: the quantizer swaps the modules and has no load operation, so fastload reads each stored
tensor (``qweight``, ``qzeros``, ``scales``, ``g_idx``) into the buffer the swapped module
declares, and the quantizer's ``postprocess_model`` (gptqmodel's post-init: GPTQ's v1 zero
points made v2 in place) runs on them as transformers runs it. The model is transformers' own:
the same module classes and attributes, buffers bitwise, logits, ``hf_quantizer`` (and
``hf_device_map``, which gptqmodel sets for GPTQ) and ``save_pretrained`` files. The
checkpoints are tiny Llamas in each method's layout (:func:`vllm_models.quantize`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("gptqmodel")

from quantized_checkpoints import (  # noqa: E402
    assert_saves_alike,
    gptq_awq_checkpoint,
    patched_and_transformers,
    rewritten,
)
from test_hf_quantized import assert_same_quantized_model  # noqa: E402

import fastload  # noqa: E402
from fastload.core.basics.errors import CheckpointError, ModelMismatchError  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")

METHODS = ["gptq", "awq"]
PROJ = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module", params=METHODS)
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "gptq":  # transformers' GPTQ quantizer is optimum's
        pytest.importorskip("optimum")
    return gptq_awq_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _method(directory: Path) -> str:
    return directory.parent.name.rstrip("0123456789")


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_a_gptq_or_awq_checkpoint_loads_as_transformers_loads_it(
    quantized: Path, read_mode: str
) -> None:
    want = _transformers(quantized)
    got, report = fastload.from_pretrained(quantized, read_mode=read_mode, output_loading_info=True)
    method = _method(quantized)
    assert report.quant_method == method
    assert f"quantized: {method}" in report.summary()
    assert not report.missing and not report.unexpected and not report.mismatched
    stored = {k for f in report.files for k in fastload.safe_open(f).keys()}
    assert report.tensors_loaded == len(stored)  # every stored tensor read as it is stored
    assert type(got.get_submodule(PROJ)).__module__.startswith("gptqmodel.nn_modules.qlinear")
    assert getattr(got, "hf_device_map", None) == getattr(want, "hf_device_map", None)
    assert_same_quantized_model(got, want)
    assert torch.isfinite(got(torch.tensor([[1, 5, 9]])).logits).all()


def test_under_the_patch_a_gptq_or_awq_checkpoint_is_read_by_fastload(
    quantized: Path, tmp_path: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(quantized, _method(quantized), transformers_loads)
    assert_same_quantized_model(got, want)
    assert_saves_alike(got, want, tmp_path)


def test_a_packed_weight_of_the_wrong_shape_is_refused_naming_it(
    quantized: Path, tmp_path: Path
) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{PROJ}.qweight"] = tensors[f"{PROJ}.qweight"][:-1].contiguous()

    with pytest.raises(ModelMismatchError, match=rf"{PROJ}\.qweight"):
        fastload.from_pretrained(rewritten(quantized, tmp_path, change))


def test_a_missing_scale_is_a_checkpoint_error_naming_it(quantized: Path, tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[f"{PROJ}.scales"]

    with pytest.raises(CheckpointError, match=rf"{PROJ}\.scales"):
        fastload.from_pretrained(rewritten(quantized, tmp_path, change))


def test_scales_of_the_wrong_dtype_are_refused_naming_them(quantized: Path, tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{PROJ}.qzeros"] = tensors[f"{PROJ}.qzeros"].to(torch.int64)

    with pytest.raises(CheckpointError, match=rf"{PROJ}\.qzeros"):
        fastload.from_pretrained(rewritten(quantized, tmp_path, change))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_onto_a_gpu_the_modules_are_the_ones_transformers_picks_for_it(quantized: Path) -> None:
    """gptqmodel picks its module class by the device map the quantizer is given: ``device=
    "cuda"`` reaches it as transformers' ``device_map="cuda"`` does (a GPU kernel, not the CPU's
    modules with CUDA tensors)."""
    want = _transformers(quantized, device_map="cuda")
    got = fastload.from_pretrained(quantized, device="cuda")
    assert type(got.get_submodule(PROJ)) is type(want.get_submodule(PROJ))
    assert got.get_submodule(PROJ).qweight.device.type == "cuda"
