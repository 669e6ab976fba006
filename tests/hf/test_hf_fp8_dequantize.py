"""FP8 fine-grained checkpoints (``quant_method: fp8``, 128x128 block scales in
``weight_scale_inv``) on a machine without a GPU, where transformers dequantizes them on load
(``Fp8Dequantize``): fastload reads the FP8 weights and scales, runs transformers' own operation
on them (:mod:`fastload.hf.load_ops`) and the model is transformers' own, bitwise. The
checkpoint is written as transformers' FP8 quantizer stores one (its quantizer needs a GPU to
quantize): e4m3 weights, float32 inverse scales ``[ceil(out/128), ceil(in/128)]``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' FP8 quantizer requires it

import quantized_checkpoints  # noqa: E402
from quantized_checkpoints import (  # noqa: E402
    assert_same_model,
    assert_saves_alike,
    conversions,
    operation_order,
    patched_and_transformers,
    rewritten,
)
from test_hf_quantized import assert_same_quantized_model  # noqa: E402

import fastload  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("unpatched"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="transformers keeps FP8 on a GPU"),
]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_checkpoints.fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


@pytest.mark.parametrize(
    ("read_mode", "dtype"),
    [("pread", None), ("mmap", None), ("mmap", torch.float32), ("pread", torch.float16)],
)
def test_an_fp8_checkpoint_dequantized_on_load_is_transformers_model(
    fp8_checkpoint: Path, read_mode: str, dtype: torch.dtype | None
) -> None:
    """Dequantized into the model's dtype (the checkpoint's bf16, or the one asked for)."""
    options = {} if dtype is None else {"dtype": dtype}
    want = _transformers(fp8_checkpoint, **options)
    got, report = fastload.from_pretrained(
        fp8_checkpoint, read_mode=read_mode, output_loading_info=True, **options
    )
    assert report.quant_method == "fp8" and report.quant_seconds > 0
    assert "quantized: fp8" in report.summary()
    assert not report.missing and not report.unexpected and not report.mismatched
    assert not report.authorized_unexpected  # every scale was used
    weight = got.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == (dtype or torch.bfloat16)
    assert_same_model(got, want)


def test_the_operations_run_in_the_order_of_the_file_one_at_a_time(
    fp8_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    done = operation_order(fp8_checkpoint, Fp8Dequantize, monkeypatch)
    assert len(done) == 14  # 7 projections of 2 layers
    for names, target in done:
        assert sorted(names) == sorted([target, target + "_scale_inv"])


def test_under_the_patch_an_fp8_checkpoint_is_read_by_fastload(
    fp8_checkpoint: Path, tmp_path: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(fp8_checkpoint, "fp8", transformers_loads)
    assert_same_model(got, want)


def test_save_pretrained_writes_what_it_writes_of_transformers_model(
    fp8_checkpoint: Path, tmp_path: Path
) -> None:
    """A dequantized model saves as transformers' does: bf16 weights, no quantization config."""
    got = fastload.from_pretrained(fp8_checkpoint)
    assert_saves_alike(got, _transformers(fp8_checkpoint), tmp_path)
    saved = json.loads((tmp_path / "fastload" / "config.json").read_text())
    assert "quantization_config" not in saved


def test_weights_and_scales_in_other_shards_load_as_transformers_loads_them(
    fp8_checkpoint: Path, tmp_path: Path
) -> None:
    """Every weight in one file, every scale in another: each operation's inputs are read from
    both files (one read per file)."""
    import safetensors.torch as st

    tensors = st.load_file(str(fp8_checkpoint / "model.safetensors"))
    shards = {
        "model-00001-of-00002.safetensors": {
            k: v for k, v in tensors.items() if not k.endswith("_scale_inv")
        },
        "model-00002-of-00002.safetensors": {
            k: v for k, v in tensors.items() if k.endswith("_scale_inv")
        },
    }
    for f in fp8_checkpoint.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    weight_map = {}
    for file, part in shards.items():
        st.save_file(part, str(tmp_path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got, report = fastload.from_pretrained(tmp_path, output_loading_info=True)
    assert len(report.files) == 2 and not report.missing and not report.unexpected
    assert_same_model(got, _transformers(tmp_path))


def test_scales_stored_under_transformers_legacy_name_load_as_transformers_loads_them(
    fp8_checkpoint: Path, tmp_path: Path
) -> None:
    """Scales stored as ``<module>.scale`` (DeepSeek-V4's naming), which transformers' FP8
    quantizer renames to ``weight_scale_inv`` before its converters match them."""

    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
            tensors[name.removesuffix(".weight_scale_inv") + ".scale"] = tensors.pop(name)

    directory = rewritten(fp8_checkpoint, tmp_path, rename)
    got, report = fastload.from_pretrained(directory, output_loading_info=True)
    assert not report.missing and not report.unexpected and not report.authorized_unexpected
    assert_same_model(got, _transformers(directory))


@pytest.fixture
def no_operation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The targets transformers' dequantize ran for (none, where the plan refuses)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return conversions(Fp8Dequantize, monkeypatch)


def test_a_missing_scale_is_refused_naming_it_before_reading(
    fp8_checkpoint: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    directory = rewritten(fp8_checkpoint, tmp_path, lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(fastload.CheckpointError, match=rf"'{name}'.*scale '{name}_scale_inv'"):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_a_scale_of_the_wrong_shape_is_refused_naming_it_before_reading(
    fp8_checkpoint: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"

    def narrow(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:, :1].contiguous()  # [2, 1]: the weight is [256, 384]

    directory = rewritten(fp8_checkpoint, tmp_path, narrow)
    with pytest.raises(
        fastload.ModelMismatchError, match=rf"tensor '{name}' has shape \[2, 1\].*shape \[2, 3\]"
    ):
        fastload.from_pretrained(directory)
    assert no_operation == []


def test_a_weight_of_the_wrong_shape_is_refused_naming_it_before_reading(
    fp8_checkpoint: Path, tmp_path: Path, no_operation: list[str]
) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"

    def narrow(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:128].contiguous()

    directory = rewritten(fp8_checkpoint, tmp_path, narrow)
    with pytest.raises(fastload.ModelMismatchError, match=rf"tensor '{name}' has shape \[128,"):
        fastload.from_pretrained(directory)
    assert no_operation == []


@pytest.fixture
def kept_in_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' FP8 quantizer as on a GPU (compute capability 8.9 and up): it keeps the
    checkpoint in FP8 (its ``FP8Linear`` modules) instead of dequantizing. On this CPU its
    environment check would turn dequantizing on; without it the modules build here too (their
    forward needs the hub's FP8 kernels: both loaders' models fail it alike)."""
    from transformers.quantizers import quantizer_finegrained_fp8 as fp8

    monkeypatch.setattr(fp8.FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)


@pytest.mark.usefixtures("kept_in_fp8")
@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_fp8_kept_in_fp8_is_read_into_transformers_fp8_modules(
    fp8_checkpoint: Path, read_mode: str, no_operation: list[str]
) -> None:
    """Stored as it runs: each FP8 weight and its block scales go into the ``FP8Linear``
    transformers' quantizer swapped in, as stored; no operation runs."""
    want = _transformers(fp8_checkpoint)
    got, report = fastload.from_pretrained(
        fp8_checkpoint, read_mode=read_mode, output_loading_info=True
    )
    assert report.quant_method == "fp8" and no_operation == []
    assert not report.missing and not report.unexpected and not report.mismatched
    up = got.model.layers[0].mlp.up_proj
    assert type(up).__name__ == "FP8Linear" and up.weight.dtype == torch.float8_e4m3fn
    assert_same_quantized_model(got, want)


@pytest.mark.usefixtures("kept_in_fp8")
def test_under_the_patch_fp8_kept_in_fp8_is_read_by_fastload(
    fp8_checkpoint: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(fp8_checkpoint, "fp8", transformers_loads)
    assert type(got.model.layers[0].mlp.up_proj).__name__ == "FP8Linear"
    assert_same_quantized_model(got, want)


def test_a_model_made_by_a_load_operation_is_not_reloaded(fp8_checkpoint: Path) -> None:
    """A reload reads stored tensors as they are: the FP8 bytes are not the model's weights."""
    model = fastload.from_pretrained(fp8_checkpoint)
    with pytest.raises(fastload.UnsupportedError, match="load operation"):
        fastload.reload(model, fp8_checkpoint)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="transformers keeps FP8 in FP8 on a GPU of compute capability 8.9 and up",
)
def test_on_a_gpu_fp8_kept_in_fp8_loads_as_transformers_loads_it(fp8_checkpoint: Path) -> None:
    """Where transformers keeps FP8 by itself (no environment check bypassed): onto the GPU,
    the same ``FP8Linear`` modules and tensors bitwise as transformers' ``device_map="cuda"``,
    and the same logits (or the same error, where the hub's FP8 kernels cannot be fetched)."""
    want = _transformers(fp8_checkpoint, device_map="cuda")
    got, report = fastload.from_pretrained(fp8_checkpoint, device="cuda", output_loading_info=True)
    assert report.quant_method == "fp8"
    up = got.model.layers[0].mlp.up_proj
    assert type(up).__name__ == "FP8Linear" and up.weight.device.type == "cuda"
    assert_same_quantized_model(got.cpu(), want.cpu())
