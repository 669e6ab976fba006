"""compressed-tensors' compression of the meta skeleton runs once per kind of layer
(:mod:`fastload.hf.meta_compression`): the compressor's own ``compress`` is counted from
outside the wrapping (the count is installed before the load wraps it), the model stays
transformers' own (tests/hf/test_hf_quantized.py compares every format), and tensors with data
pass through untouched. Fresh skeleton layers are not cleared of quantization parameters they do
not hold (compressed-tensors' ``clear_all_qparams``, counted from outside the same way); a
layer that holds some is cleared by compressed-tensors itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantized_checkpoints import (  # noqa: E402
    COMPRESSED_TENSORS_FORMATS,
    compressed_tensors_checkpoint,
)

import fastload  # noqa: E402
from fastload.hf.meta_compression import compress_once_per_kind  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")


def _recording(
    monkeypatch: pytest.MonkeyPatch, cls: type, name: str, record: Callable[..., Any]
) -> list[Any]:
    """Each call of the classmethod ``cls.name`` (its own, not a parent's), recorded as
    ``record(*args)`` before the call goes on to it."""
    calls: list[Any] = []
    function = cls.__dict__[name].__func__

    def recorded(klass: type, *args: Any) -> Any:
        calls.append(record(*args))
        return function(klass, *args)

    monkeypatch.setattr(cls, name, classmethod(recorded))
    return calls


def _counted(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[bool]:
    """Each call of ``cls``' own ``compress``: whether its weight was on meta."""
    return _recording(
        monkeypatch, cls, "compress", lambda sd, _: sd["weight"].device.type == "meta"
    )


@pytest.mark.parametrize(
    "fmt",
    [f for f in COMPRESSED_TENSORS_FORMATS if f[0] in ("int8", "fp8", "nvfp4")],
    ids=lambda f: f[0],
)
def test_the_compressor_runs_once_per_kind_of_layer(
    fmt: tuple[str, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compressed_tensors.compressors import NaiveQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    name, scheme, form = fmt
    directory = compressed_tensors_checkpoint(tmp_path, scheme, form)
    cls = NVFP4PackedCompressor if name == "nvfp4" else NaiveQuantizationCompressor
    calls = _counted(monkeypatch, cls)
    model = fastload.from_pretrained(directory)
    # 2 layers x 7 projections; q and o, k and v, gate and up have one shape each: 4 kinds
    layers = [m for m in model.modules() if hasattr(m, "quantization_scheme")]
    kinds = {
        tuple((n, p.dtype, tuple(p.shape)) for n, p in m.named_parameters(recurse=False))
        for m in layers
    }
    assert (len(layers), len(kinds)) == (14, 4)
    assert calls == [True] * len(kinds)
    assert isinstance(cls.__dict__["compress"], classmethod)


def _int8_channel() -> tuple[Any, Any]:
    """compressed-tensors' int8 compressor and a symmetric int8 scheme per output channel."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="int-quantized")
    return IntQuantizationCompressor, scheme


def test_tensors_with_data_are_compressed_every_time_as_without_the_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from compressed_tensors.compressors import NaiveQuantizationCompressor

    calls = _counted(monkeypatch, NaiveQuantizationCompressor)
    compressor, scheme = _int8_channel()
    torch.manual_seed(0)
    state = {"weight": torch.randn(8, 16), "weight_scale": torch.rand(8, 1) + 0.01}
    want = compressor.compress(dict(state), scheme)
    with compress_once_per_kind() as memo:
        first = compressor.compress(dict(state), scheme)
        second = compressor.compress(dict(state), scheme)
    assert memo is not None and (memo.calls, memo.runs) == (2, 2)
    assert calls == [False, False, False]
    for got in (first, second):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_compressors_are_restored_after_an_error() -> None:
    from compressed_tensors.compressors import NaiveQuantizationCompressor

    before = NaiveQuantizationCompressor.__dict__["compress"]
    with pytest.raises(RuntimeError, match="inside"), compress_once_per_kind():
        assert NaiveQuantizationCompressor.__dict__["compress"] is not before
        raise RuntimeError("inside")
    assert NaiveQuantizationCompressor.__dict__["compress"] is before


@pytest.mark.parametrize(
    ("form", "changes", "held"),
    [
        # the packed width follows the scheme's bits: 4 bits 8 to an int32, 8 bits 4
        ("pack-quantized", {"num_bits": 8}, "weight_packed"),
        # an asymmetric scheme keeps its zero points, a symmetric one drops them
        ("int-quantized", {"symmetric": False}, "weight_zero_point"),
    ],
    ids=["bits", "symmetry"],
)
def test_layers_of_one_shape_under_two_schemes_each_get_their_own_layout(
    tmp_path: Path, form: str, changes: dict[str, Any], held: str
) -> None:
    """q_proj and o_proj have one shape; o_proj's scheme differs: the scheme is part of a
    kind, so each keeps the layout its own scheme gives it, as transformers'."""
    from test_hf_quantized import assert_same_quantized_model
    from transformers import AutoModelForCausalLM

    bits = 4 if form == "pack-quantized" else 8
    directory = compressed_tensors_checkpoint(
        tmp_path, ("int", bits), form, other=(r".*o_proj", changes)
    )
    want = AutoModelForCausalLM.from_pretrained(directory)
    got = fastload.from_pretrained(directory)
    attention = got.model.layers[0].self_attn
    assert attention.q_proj.weight_scale.shape == attention.o_proj.weight_scale.shape
    mine, theirs = getattr(attention.o_proj, held, None), getattr(attention.q_proj, held, None)
    assert mine is not None and (theirs is None or theirs.shape != mine.shape)
    assert_same_quantized_model(got, want)


def test_calls_from_another_thread_go_to_the_compressor_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from compressed_tensors.compressors import NaiveQuantizationCompressor

    calls = _counted(monkeypatch, NaiveQuantizationCompressor)
    compressor, scheme = _int8_channel()
    state = {
        "weight": torch.empty(8, 16, device="meta"),
        "weight_scale": torch.empty(8, 1, device="meta"),
    }

    def twice() -> None:
        for _ in range(2):
            compressor.compress(dict(state), scheme)

    with compress_once_per_kind() as memo:
        worker = threading.Thread(target=twice)
        worker.start()
        worker.join()
        assert memo is not None and memo.calls == 0
        twice()  # the load's own thread: once
    assert calls == [True, True, True]
    assert (memo.calls, memo.runs) == (2, 1)


def test_a_compress_replaced_meanwhile_is_left_as_it_was_replaced() -> None:
    from compressed_tensors.compressors import NaiveQuantizationCompressor

    before = NaiveQuantizationCompressor.__dict__["compress"]
    other = classmethod(lambda cls, state_dict, scheme: state_dict)
    try:
        with compress_once_per_kind():
            NaiveQuantizationCompressor.compress = other
        assert NaiveQuantizationCompressor.__dict__["compress"] is other
    finally:
        NaiveQuantizationCompressor.compress = before


def test_subclassed_meta_tensors_go_to_the_compressor_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The memo reads shapes with torch's function modes off, so it keys plain tensors only:
    a subclass (its own ``__torch_function__`` may answer otherwise) is compressed each time."""
    from compressed_tensors.compressors import NaiveQuantizationCompressor

    calls = _counted(monkeypatch, NaiveQuantizationCompressor)
    compressor, scheme = _int8_channel()
    state = {
        "weight": torch.nn.Parameter(torch.empty(8, 16, device="meta")),
        "weight_scale": torch.empty(8, 1, device="meta"),
    }
    with compress_once_per_kind() as memo:
        for _ in range(2):
            compressor.compress(dict(state), scheme)
    assert memo is not None and (memo.calls, memo.runs) == (2, 2)
    assert calls == [True, True]


# --- compressed-tensors' clearing of quantization parameters (no_clearing_of_fresh_modules) ---


def _counted_clearing(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each call of compressed-tensors' own ``clear_all_qparams``: the module's class name."""
    from compressed_tensors.quantization.quant_metadata import QuantizationMetadata

    return _recording(
        monkeypatch, QuantizationMetadata, "clear_all_qparams", lambda m: type(m).__name__
    )


@pytest.mark.parametrize(
    "fmt",
    [f for f in COMPRESSED_TENSORS_FORMATS if f[0] in ("int8", "int4-packed", "nvfp4")],
    ids=lambda f: f[0],
)
def test_fresh_layers_of_the_skeleton_are_not_cleared(
    fmt: tuple[str, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' load clears each of the 14 quantized layers before initializing it; the
    skeleton's hold nothing to clear, so fastload's load never calls the clearing (the model
    is transformers' own: tests/hf/test_hf_quantized.py)."""
    from transformers import AutoModelForCausalLM

    name, scheme, form = fmt
    directory = compressed_tensors_checkpoint(tmp_path, scheme, form)
    calls = _counted_clearing(monkeypatch)
    AutoModelForCausalLM.from_pretrained(directory)
    assert calls == ["Linear"] * 14  # the count sees transformers' clearing
    calls.clear()
    model = fastload.from_pretrained(directory)
    assert calls == []
    assert sum(hasattr(m, "quantization_scheme") for m in model.modules()) == 14


def _holding() -> torch.nn.Module:
    """A Linear holding quantization parameters as a parameter, a buffer and an attribute."""
    module = torch.nn.Linear(16, 8, device="meta")
    module.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(8, 1)))
    module.register_buffer("weight_zero_point", torch.zeros(8, 1))
    module.input_scale = torch.ones(1)
    return module


class _ClassScale(torch.nn.Linear):
    """A layer whose class defines one of the cleared names (compressed-tensors' clearing
    then fails to delete it)."""

    output_scale = None


def _state(module: torch.nn.Module) -> tuple[set[str], set[str], set[str]]:
    return set(module._parameters), set(module._buffers), set(vars(module))


def test_layers_holding_quantization_parameters_are_cleared_as_compressed_tensors_clears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from compressed_tensors.quantization.quant_metadata import QuantizationMetadata

    from fastload.hf.meta_compression import no_clearing_of_fresh_modules

    want = _holding()
    QuantizationMetadata.clear_all_qparams(want)
    assert "weight_scale" not in want._parameters and "input_scale" not in vars(want)
    with pytest.raises(AttributeError) as raised:
        QuantizationMetadata.clear_all_qparams(_ClassScale(16, 8))
    calls = _counted_clearing(monkeypatch)
    got = _holding()
    with no_clearing_of_fresh_modules():
        QuantizationMetadata.clear_all_qparams(got)
        QuantizationMetadata.clear_all_qparams(torch.nn.Linear(16, 8))
        with pytest.raises(AttributeError, match=str(raised.value)):
            QuantizationMetadata.clear_all_qparams(_ClassScale(16, 8))
    assert _state(got) == _state(want)
    assert calls == ["Linear", "_ClassScale"]  # the fresh Linear alone is skipped


def test_the_clearing_from_another_thread_and_after_the_block_is_compressed_tensors_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    from compressed_tensors.quantization.quant_metadata import QuantizationMetadata

    from fastload.hf.meta_compression import no_clearing_of_fresh_modules

    calls = _counted_clearing(monkeypatch)
    counted = QuantizationMetadata.__dict__["clear_all_qparams"]
    with no_clearing_of_fresh_modules():
        assert QuantizationMetadata.__dict__["clear_all_qparams"] is not counted
        worker = threading.Thread(
            target=QuantizationMetadata.clear_all_qparams, args=(torch.nn.Linear(4, 4),)
        )
        worker.start()
        worker.join()
    assert QuantizationMetadata.__dict__["clear_all_qparams"] is counted
    QuantizationMetadata.clear_all_qparams(torch.nn.Linear(4, 4))
    assert calls == ["Linear", "Linear"]
