"""Pre-quantized checkpoints through fastload (:mod:`fastload.hf.quantized`): transformers'
quantizer swaps the modules, fastload reads the tensors, and the model is transformers' own:
the same module classes, parameters and buffers (bitwise, dtypes, trainability), logits,
``hf_quantizer`` and ``save_pretrained`` files. The checkpoints are tiny Llamas quantized by
compressed-tensors' own code (weight-only int8, int4 packed into int32, FP8 e4m3, NVFP4 and
MXFP4), formats stored as they run, which transformers keeps as stored on a CPU. The same
checkpoints with ``dequantize: true``: tests/hf/test_hf_compressed_dequantize.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantized_checkpoints import (  # noqa: E402
    COMPRESSED_TENSORS_FORMATS,
    compressed_tensors_checkpoint,
    patched_and_transformers,
)
from tensor_samples import raw_bytes  # noqa: E402

import fastload  # noqa: E402
from fastload.hf import patch  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")

FORMATS = COMPRESSED_TENSORS_FORMATS


@pytest.fixture(scope="module", params=FORMATS, ids=[f[0] for f in FORMATS])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, scheme, form = request.param
    return compressed_tensors_checkpoint(tmp_path_factory.mktemp(name), scheme, form)


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


def assert_same_quantized_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Module classes and attributes, parameters and buffers (names, dtypes, shapes, bytes,
    trainability), the quantizer, the parallel plans and the config's quantization config; then
    the logits of a fixed input, or the same error from it (last: compressed-tensors changes its
    modules on the first forward)."""
    assert type(got) is type(want)
    got_modules, want_modules = dict(got.named_modules()), dict(want.named_modules())
    assert list(got_modules) == list(want_modules)
    for name, module in want_modules.items():
        mine = got_modules[name]
        assert type(mine) is type(module), name
        public = {k for k in vars(module) if not k.startswith("_")}
        assert {k for k in vars(mine) if not k.startswith("_")} == public, name
    for kind in ("named_parameters", "named_buffers"):
        got_tensors, want_tensors = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert list(got_tensors) == list(want_tensors), kind
        for name, w in want_tensors.items():
            g = got_tensors[name]
            assert (g.dtype, g.shape, g.requires_grad) == (w.dtype, w.shape, w.requires_grad), name
            assert torch.equal(raw_bytes(g.detach()), raw_bytes(w.detach())), name
    assert type(got.hf_quantizer) is type(want.hf_quantizer)
    assert (got.tp_plan, got.ep_plan) == (want.tp_plan, want.ep_plan)  # as the quantizer left them
    assert got.config.quantization_config.to_dict() == want.config.quantization_config.to_dict()
    assert got.training == want.training
    mine, theirs = _forward(got), _forward(want)
    if isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor) and torch.equal(mine, theirs)
    else:  # a forward transformers' model cannot run (float16 activations, bf16 NVFP4 weights)
        assert mine == theirs


def _forward(model: torch.nn.Module) -> torch.Tensor | tuple[type, str]:
    """The logits of a fixed input, or the error the forward raised."""
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    try:
        with torch.no_grad():
            return model(ids).logits  # type: ignore[no-any-return]
    except (RuntimeError, ValueError) as e:  # a kernel this machine lacks: compared as raised
        return type(e), str(e)


@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_a_compressed_tensors_checkpoint_loads_as_transformers_loads_it(
    quantized: Path, read_mode: str
) -> None:
    want = _transformers(quantized)
    got, report = fastload.from_pretrained(quantized, read_mode=read_mode, output_loading_info=True)
    assert report.quant_method == "compressed-tensors"
    assert "quantized: compressed-tensors" in report.summary()
    assert not report.missing and not report.unexpected and not report.mismatched
    stored = {k for f in report.files for k in fastload.safe_open(f).keys()}
    assert report.tensors_loaded == len(stored)  # every stored tensor read as it is stored
    assert_same_quantized_model(got, want)
    assert isinstance(_forward(got), torch.Tensor)  # in its stored dtype, the model runs


def test_under_the_patch_a_compressed_tensors_checkpoint_is_read_by_fastload(
    quantized: Path, tmp_path: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(quantized, "compressed-tensors", transformers_loads)
    want.save_pretrained(tmp_path / "transformers")
    got.save_pretrained(tmp_path / "fastload")
    names = sorted(p.name for p in (tmp_path / "transformers").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fastload").iterdir())
    for name in names:  # what save_pretrained writes of it is what it writes of transformers'
        mine = (tmp_path / "fastload" / name).read_bytes()
        assert mine == (tmp_path / "transformers" / name).read_bytes(), name
    assert_same_quantized_model(got, want)


def _with_quantization(directory: Path, tmp_path: Path, **changes: object) -> Path:
    """A copy of the checkpoint whose config's quantization_config has ``changes``."""
    copy = tmp_path / "changed"
    copy.mkdir()
    for path in directory.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_a_scale_of_the_wrong_shape_is_refused_naming_the_tensor_before_reading(
    quantized: Path, tmp_path: Path
) -> None:
    import safetensors.torch as st

    directory = _with_quantization(quantized, tmp_path)
    path = directory / "model.safetensors"
    tensors = st.load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:7]
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(fastload.ModelMismatchError, match=rf"tensor '{name}' has shape \[7,"):
        fastload.from_pretrained(directory)


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}])
def test_a_device_map_placing_everything_on_the_cpu_loads_as_transformers_loads_it(
    quantized: Path, device_map: object
) -> None:
    want = _transformers(quantized, device_map=device_map)
    got, report = fastload.from_pretrained(
        quantized, device_map=device_map, output_loading_info=True
    )
    assert report.quant_method == "compressed-tensors" and report.device == "cpu"
    assert not hasattr(got, "hf_device_map") and not hasattr(want, "hf_device_map")
    assert_same_quantized_model(got, want)


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"device_map": {"model": "cpu", "lm_head": "disk"}, "offload_folder": "off"}, "disk"),
        ({"device_map": "auto", "max_memory": {"cpu": "1GiB"}}, "max_memory={'cpu': '1GiB'}"),
        ({"device_map": "disk"}, "device_map='disk'"),
        ({"tp_plan": {"model.layers.*.mlp.up_proj": "colwise"}}, "a tp_plan"),
    ],
)
def test_a_quantized_load_over_several_places_is_refused_naming_the_map(
    quantized: Path, tmp_path: Path, options: dict, what: str
) -> None:
    if "offload_folder" in options:
        options = {**options, "offload_folder": str(tmp_path / "off")}
    with pytest.raises(fastload.UnsupportedError) as caught:
        fastload.from_pretrained(quantized, **options)
    message = str(caught.value)
    assert "quant_method='compressed-tensors'" in message and what in message, message
    assert "onto one device" in message, message


def test_a_sharded_checkpoint_loaded_as_float16_loads_as_transformers_loads_it(
    quantized: Path, tmp_path: Path
) -> None:
    _transformers(quantized).save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    want = _transformers(tmp_path, dtype=torch.float16)
    got = fastload.from_pretrained(tmp_path, dtype=torch.float16)
    assert got.model.norm.weight.dtype == torch.float16
    assert_same_quantized_model(got, want)


def test_a_quantized_model_reloads_in_place(quantized: Path, tmp_path: Path) -> None:
    model = fastload.from_pretrained(quantized, mmap="copy")
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fastload.reload(model, quantized)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights
    assert_same_quantized_model(model, _transformers(quantized))


def test_a_missing_scale_is_a_checkpoint_error_naming_it(quantized: Path, tmp_path: Path) -> None:
    import safetensors.torch as st

    directory = _with_quantization(quantized, tmp_path)
    path = directory / "model.safetensors"
    tensors = st.load_file(str(path))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    del tensors[name]
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    # transformers reports it missing and keeps what it allocated; the direct API refuses it from
    # the plan (an integer scale, MXFP4's, has no NaN an initialization check could find)
    with pytest.raises(fastload.CheckpointError, match=rf"not in the checkpoint: {name}"):
        fastload.from_pretrained(directory)


def test_a_merge_of_experts_that_needs_a_load_operation_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    # transformers 5 saves Mixtral's experts one per tensor, unquantized (compressed-tensors
    # quantizes Linear modules, and the merged experts are not); its quantizer then puts its
    # dequantize operation before the merge, which fastload does not run
    directory = compressed_tensors_checkpoint(tmp_path, moe=True)
    with pytest.raises(
        fastload.UnsupportedError, match=r"needs CompressedTensorsDequantize, a load operation"
    ):
        fastload.from_pretrained(directory)
    with fastload.patch_transformers(), pytest.raises(RuntimeError) as theirs:
        _transformers(directory)  # transformers' own loader, and its own error
    assert not isinstance(theirs.value, fastload.FastloadError)
    assert patch.last_fallback is not None and "a load operation" in patch.last_fallback


def test_a_weight_of_the_wrong_dtype_is_refused_naming_it_before_reading(
    quantized: Path, tmp_path: Path
) -> None:
    import safetensors.torch as st

    directory = _with_quantization(quantized, tmp_path)
    path = directory / "model.safetensors"
    tensors = st.load_file(str(path))
    quantized_dtypes = (torch.int8, torch.int32, torch.uint8, torch.float8_e4m3fn)
    name = next(k for k, t in tensors.items() if t.dtype in quantized_dtypes)
    stored = tensors[name]  # its values as int16 (FP8 through its bytes: no cast from it)
    tensors[name] = (stored.view(torch.uint8) if stored.is_floating_point() else stored).to(
        torch.int16
    )
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(fastload.CheckpointError, match=rf"tensor '{name}' is stored as I16"):
        fastload.from_pretrained(directory)
