"""torchao's pre-quantized checkpoints (``quant_method: torchao``, saved as safetensors by
transformers' ``save_pretrained``: each quantized weight's tensors, ``_weight_qdata``,
``_weight_scale``, ..., and its tensor subclass in the file's metadata) on the CPU, which
transformers loads by deserializing them (``TorchAoDeserialize``: torchao's
``unflatten_tensor_state_dict`` makes the subclass of the stored tensors): fastload reads the
stored tensors, runs transformers' own operation on them (:mod:`fastload.hf.load_ops`) and the
model is transformers' own: the same ``nn.Linear`` modules holding the same torchao subclasses
(their inner tensors bitwise, their attributes), the same logits, ``hf_quantizer`` and
``save_pretrained`` files. The checkpoints are tiny Llamas quantized by transformers' own
``TorchAoConfig`` on the CPU (int8 weight-only, int8 dynamic-activation, float8 weight-only: the
ones that load on a CPU with torchao 0.18)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
torchao = pytest.importorskip("torchao")

from quantized_checkpoints import (  # noqa: E402
    assert_saves_alike,
    operation_order,
    patched_and_transformers,
    rewritten,
    torchao_checkpoint,
)
from tensor_samples import raw_bytes  # noqa: E402

import fastload  # noqa: E402
from fastload.core.basics.errors import CheckpointError, ModelMismatchError  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")

CONFIGS = [
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "Float8WeightOnlyConfig",
]
PROJ = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module", params=CONFIGS)
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return torchao_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


def _contents(param: torch.Tensor) -> dict[str, object]:
    """A parameter's class, dtype, shape and trainability; a torchao subclass' inner tensors
    (as bytes) and attributes, a plain tensor's bytes."""
    from torchao.utils import TorchAOBaseTensor

    data = param.detach()
    out: dict[str, object] = {
        "class": type(param),
        "data": type(data),
        "meta": (param.dtype, tuple(param.shape), param.requires_grad),
    }
    if not isinstance(data, TorchAOBaseTensor):
        out["bytes"] = raw_bytes(data).numpy().tobytes()
        return out
    tensors = [*data.tensor_data_names, *getattr(data, "optional_tensor_data_names", [])]
    attributes = [
        *data.tensor_attribute_names,
        *getattr(data, "optional_tensor_attribute_names", []),
    ]
    for name in tensors:
        inner = getattr(data, name, None)
        out[name] = None if inner is None else (inner.dtype, raw_bytes(inner).numpy().tobytes())
    for name in attributes:
        out[name] = repr(getattr(data, name, None))
    return out


def assert_same_torchao_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    assert [type(m) for m in got.modules()] == [type(m) for m in want.modules()]
    for kind in ("named_parameters", "named_buffers"):
        got_tensors, want_tensors = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert list(got_tensors) == list(want_tensors), kind
        for name, w in want_tensors.items():
            assert _contents(got_tensors[name]) == _contents(w), name
    assert type(got.hf_quantizer) is type(want.hf_quantizer)
    assert got.config.quantization_config.to_dict() == want.config.quantization_config.to_dict()
    for flag in ("is_quantized", "quantization_method"):
        assert getattr(got, flag, None) == getattr(want, flag, None), flag
    assert got.training == want.training
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("read_mode", ["pread", "mmap"])
def test_a_torchao_checkpoint_loads_as_transformers_loads_it(
    quantized: Path, read_mode: str
) -> None:
    from torchao.utils import TorchAOBaseTensor

    want = _transformers(quantized)
    got, report = fastload.from_pretrained(quantized, read_mode=read_mode, output_loading_info=True)
    assert report.quant_method == "torchao"
    assert "quantized: torchao" in report.summary()
    assert not report.missing and not report.unexpected and not report.mismatched
    assert isinstance(got.get_submodule(PROJ).weight.detach(), TorchAOBaseTensor)
    assert_same_torchao_model(got, want)


def test_under_the_patch_a_torchao_checkpoint_is_read_by_fastload(
    quantized: Path, tmp_path: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(quantized, "torchao", transformers_loads)
    assert_same_torchao_model(got, want)


def test_save_pretrained_writes_the_checkpoint_transformers_wrote(
    quantized: Path, tmp_path: Path
) -> None:
    """fastload's model saves byte for byte the checkpoint transformers saved of the model it
    quantized. transformers 5.25 cannot save the model it loaded from that checkpoint (its
    ``TorchAoDeserialize`` has no reverse operation: the ``NotImplementedError`` below);
    where it can, both must write the same files."""
    got = fastload.from_pretrained(quantized)
    got.save_pretrained(tmp_path / "fastload")
    names = sorted(p.name for p in quantized.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fastload").iterdir())
    for name in names:
        mine, theirs = (tmp_path / "fastload" / name).read_bytes(), (quantized / name).read_bytes()
        if name.endswith(".safetensors"):  # torchao writes its metadata in set order
            mine, theirs = _unordered(mine), _unordered(theirs)
        assert mine == theirs, name
    want = _transformers(quantized)
    try:
        want.save_pretrained(tmp_path / "transformers")
    except NotImplementedError:
        return  # transformers' own limitation (docs/quantized.md)
    assert_saves_alike(got, want, tmp_path / "both")


def _unordered(data: bytes) -> tuple[object, bytes]:
    """A safetensors file as its header (a dict: key order aside) and its data bytes."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def test_a_model_made_by_a_load_operation_is_not_reloaded(quantized: Path) -> None:
    model = fastload.from_pretrained(quantized)
    with pytest.raises(fastload.UnsupportedError, match="load operation"):
        fastload.reload(model, quantized)


def test_each_weight_is_read_then_deserialized_in_the_order_of_the_file(
    quantized: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations.torchao import TorchAoDeserialize

    done = operation_order(quantized, TorchAoDeserialize, monkeypatch)
    assert len(done) == 2 * 7  # every projection of the two layers, one at a time
    assert all(layer.endswith("proj.weight") for _, layer in done)


def test_a_missing_scale_is_a_checkpoint_error_naming_it(quantized: Path, tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[f"{PROJ}._weight_scale"]

    with pytest.raises(CheckpointError, match=rf"{PROJ}\._weight_(qdata|scale)"):
        fastload.from_pretrained(rewritten_keeping_metadata(quantized, tmp_path, change))


def test_a_scale_of_the_wrong_shape_is_refused_naming_it(quantized: Path, tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{PROJ}._weight_scale"] = tensors[f"{PROJ}._weight_scale"][:-1].contiguous()

    with pytest.raises(ModelMismatchError, match=rf"{PROJ}\._weight_scale"):
        fastload.from_pretrained(rewritten_keeping_metadata(quantized, tmp_path, change))


def test_qdata_of_the_wrong_dtype_is_refused_naming_it(quantized: Path, tmp_path: Path) -> None:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"{PROJ}._weight_qdata"] = tensors[f"{PROJ}._weight_qdata"].view(torch.uint8)

    with pytest.raises(CheckpointError, match=rf"{PROJ}\._weight_qdata"):
        fastload.from_pretrained(rewritten_keeping_metadata(quantized, tmp_path, change))


def test_a_file_without_torchao_metadata_is_refused(quantized: Path, tmp_path: Path) -> None:
    # transformers' quantizer refuses it when it reads the metadata (preprocess_model)
    with pytest.raises(CheckpointError, match="Invalid torchao safetensors metadata"):
        fastload.from_pretrained(rewritten(quantized, tmp_path, lambda tensors: None))


def rewritten_keeping_metadata(source: Path, tmp_path: Path, change: object) -> Path:
    """:func:`quantized_checkpoints.rewritten`, the file's torchao metadata kept."""
    import safetensors.torch as st

    import safetensors

    directory = rewritten(source, tmp_path, change)
    with safetensors.safe_open(str(source / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    tensors = st.load_file(str(directory / "model.safetensors"))
    st.save_file(tensors, str(directory / "model.safetensors"), metadata=metadata)
    return directory


def test_a_subclass_not_loaded_on_a_cpu_is_refused_naming_it(
    quantized: Path, tmp_path: Path
) -> None:
    import safetensors.torch as st

    import safetensors

    directory = rewritten(quantized, tmp_path, lambda tensors: None)
    with safetensors.safe_open(str(quantized / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
    entry = json.loads(metadata[f"{PROJ}.weight"])
    metadata[f"{PROJ}.weight"] = json.dumps({**entry, "_type": "Int4Tensor"})
    tensors = st.load_file(str(directory / "model.safetensors"))
    st.save_file(tensors, str(directory / "model.safetensors"), metadata=metadata)
    with pytest.raises(fastload.UnsupportedError, match=rf"{PROJ}\.weight.*Int4Tensor"):
        fastload.from_pretrained(directory)


def test_a_file_without_its_torchao_metadata_is_a_checkpoint_error_naming_the_file(
    quantized: Path, tmp_path: Path
) -> None:
    """transformers' torchao quantizer reads each file's metadata to build the model; without it
    transformers raises ``ValueError``: fastload's error is one too, a ``CheckpointError``
    naming the file (not the config)."""
    directory = rewritten(quantized, tmp_path, lambda tensors: None)  # metadata dropped
    with pytest.raises(CheckpointError, match="torchao safetensors metadata") as caught:
        fastload.from_pretrained(directory)
    assert isinstance(caught.value, ValueError)
    assert str(directory / "model.safetensors") in str(caught.value)
    assert "cannot be built from this config" not in str(caught.value)
