"""Bookkeeping of the quantizer's ``preprocess_model`` that fastload spares where its outcome is
plain, counted from outside: compressed-tensors' ``replace_direct_state_dict`` (the compressed
layers' tensors put into plain layers directly, :mod:`fastload.hf.meta_compression`) and the
naming of every parameter by transformers' ``update_parallel_plan`` where no key can be added
(:mod:`fastload.hf.quantized`). The model stays transformers' own, its parallel plans included
(``assert_same_quantized_model``); any layer or plan not plainly so goes to the library's own."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from quantized_checkpoints import (  # noqa: E402
    COMPRESSED_TENSORS_FORMATS,
    compressed_tensors_checkpoint,
)

import fastload  # noqa: E402
from fastload.hf.meta_compression import plain_replacement_of_layer_tensors  # noqa: E402
from fastload.hf.quantized import _no_empty_plan_updates  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")

FORMATS = [f for f in COMPRESSED_TENSORS_FORMATS if f[0] in ("int8", "int4-packed", "nvfp4")]


def _counted(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[str]:
    """Each call of the function ``module.name`` (as the library's own code looks it up), the
    type name of its first argument, recorded before the call goes on to it."""
    owner = importlib.import_module(module)
    function = getattr(owner, name)
    calls: list[str] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(type(args[0]).__name__)
        return function(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f[0])
def test_compressed_layers_are_read_and_set_without_compressed_tensors_own(
    fmt: tuple[str, Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_hf_quantized import assert_same_quantized_model
    from transformers import AutoModelForCausalLM

    _, scheme, form = fmt
    directory = compressed_tensors_checkpoint(tmp_path, scheme, form)
    base = "compressed_tensors.compressors.base"
    reads = _counted(monkeypatch, base, "get_direct_state_dict")
    calls = _counted(monkeypatch, base, "replace_direct_state_dict")
    want = AutoModelForCausalLM.from_pretrained(directory)
    assert calls == reads == ["Linear"] * 14  # the counts see transformers' load
    calls.clear()
    reads.clear()
    got = fastload.from_pretrained(directory)
    assert calls == reads == []
    assert_same_quantized_model(got, want)


def test_parallel_plans_that_gain_nothing_are_not_renamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' ``update_parallel_plan`` names every parameter with its layer numbers made
    ``*`` (twice: the tensor and the expert parallel plan); for a Llama no key of the
    quantizer's can be added, so fastload's load names none and its plans are transformers'."""
    from test_hf_quantized import assert_same_quantized_model
    from transformers import AutoModelForCausalLM

    directory = compressed_tensors_checkpoint(tmp_path)
    calls = _counted(
        monkeypatch, "transformers.distributed.parallel_utils", "replace_layer_number_by_wildcard"
    )
    want = AutoModelForCausalLM.from_pretrained(directory)
    assert len(calls) >= 2 * len(list(want.parameters()))  # the count sees transformers' load
    calls.clear()
    got = fastload.from_pretrained(directory)
    assert calls == []
    assert got.tp_plan  # a plan the quantizer looked at
    assert_same_quantized_model(got, want)


# --- the plain replacement against compressed-tensors' own, layer by layer ---


def _base() -> Any:
    return importlib.import_module("compressed_tensors.compressors.base")


def _meta_state() -> dict[str, Any]:
    """What a compressor gives a layer: new meta tensors and an absent bias."""
    return {
        "bias": None,
        "weight_scale": torch.empty(8, 1, device="meta"),
        "weight_packed": torch.empty(8, 2, dtype=torch.int32, device="meta"),
        "weight_shape": torch.empty(2, dtype=torch.int64, device="meta"),
    }


def _layout(module: nn.Module) -> list[tuple[Any, ...]]:
    """The module's parameters and buffers in order: kind, name, class, dtype, shape, device,
    trainability."""
    return [
        (kind, name)
        + (() if t is None else (type(t), t.dtype, tuple(t.shape), t.device.type, t.requires_grad))
        for kind, table in (("p", module._parameters), ("b", module._buffers))
        for name, t in table.items()
    ]


class _OwnSetattr(nn.Linear):
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)


class _ClassAttribute(nn.Linear):
    weight_shape = None


def _with_buffer() -> nn.Module:
    module = nn.Linear(4, 8, bias=False, device="meta")
    module.register_buffer("weight_zero_point", torch.zeros(8, 1, device="meta"))
    return module


def _layers() -> dict[str, tuple[Any, Any]]:
    """name -> (a way to make the layer, its new state): one plain, then each way of not being
    plain."""
    cpu_state = dict(_meta_state(), weight_scale=torch.ones(8, 1))
    return {
        "plain": (lambda: nn.Linear(4, 8, bias=False, device="meta"), _meta_state),
        "a bias it drops": (lambda: nn.Linear(4, 8, device="meta"), _meta_state),
        "a buffer": (_with_buffer, _meta_state),
        "a tensor with data": (
            lambda: nn.Linear(4, 8, bias=False, device="meta"),
            lambda: cpu_state,
        ),
        "its own __setattr__": (lambda: _OwnSetattr(4, 8, bias=False, device="meta"), _meta_state),
        "a class attribute": (
            lambda: _ClassAttribute(4, 8, bias=False, device="meta"),
            _meta_state,
        ),
    }


@pytest.mark.parametrize("case", list(_layers()))
def test_each_layer_is_left_as_compressed_tensors_leaves_it(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, state = _layers()[case]
    want = make()
    outcome: Any = None
    try:
        _base().replace_direct_state_dict(want, state())
    except Exception as e:  # noqa: BLE001 - the error is part of what is compared
        outcome = (type(e), str(e))
    calls = _counted(
        monkeypatch, "compressed_tensors.compressors.base", "replace_direct_state_dict"
    )
    got = make()
    with plain_replacement_of_layer_tensors():
        try:
            _base().replace_direct_state_dict(got, state())
        except Exception as e:  # noqa: BLE001
            assert outcome == (type(e), str(e))
    assert _layout(got) == _layout(want)
    assert calls == ([] if case == "plain" else [type(got).__name__])


def _read(module: nn.Module) -> list[tuple[Any, ...]]:
    """What a read of the layer's state gives: name, class, and for a tensor whether it is the
    layer's own object, its storage, shape and trainability."""
    state = _base().get_direct_state_dict(module)
    own = {id(t) for t in [*module._parameters.values(), *module._buffers.values()]}
    return [
        (name, type(t))
        + (
            ()
            if t is None
            else (id(t) in own, t.untyped_storage().data_ptr(), tuple(t.shape), t.requires_grad)
        )
        for name, t in state.items()
    ]


def _buffered(kind: Any) -> nn.Module:
    module = nn.Linear(4, 8, device="meta")
    module.register_buffer("weight_zero_point", kind(torch.zeros(8, 1, dtype=torch.int8)))
    return module


@pytest.mark.parametrize(
    "kind", [None, torch.Tensor, nn.Buffer], ids=["parameters", "a tensor", "an nn.Buffer"]
)
def test_each_layer_is_read_as_compressed_tensors_reads_it(
    kind: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = nn.Linear(4, 8, device="meta") if kind is None else _buffered(kind)
    want = _read(layer)
    calls = _counted(monkeypatch, "compressed_tensors.compressors.base", "get_direct_state_dict")
    with plain_replacement_of_layer_tensors(), torch.device("meta"):
        got = _read(layer)
    assert got == want
    assert calls == ([] if kind is None else [type(layer).__name__])


def test_a_registration_hook_sends_the_layer_to_compressed_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    layer = nn.Linear(4, 8, bias=False, device="meta")
    handle = nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: seen.append(name)
    )
    try:
        calls = _counted(
            monkeypatch, "compressed_tensors.compressors.base", "replace_direct_state_dict"
        )
        with plain_replacement_of_layer_tensors():
            _base().replace_direct_state_dict(layer, _meta_state())
    finally:
        handle.remove()
    assert calls == ["Linear"]
    assert seen == ["weight_scale", "weight_packed", "weight_shape"]


def test_replacement_from_another_thread_and_after_the_block_is_compressed_tensors_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    calls = _counted(
        monkeypatch, "compressed_tensors.compressors.base", "replace_direct_state_dict"
    )
    counted = _base().replace_direct_state_dict
    with plain_replacement_of_layer_tensors():
        assert _base().replace_direct_state_dict is not counted
        layer = nn.Linear(4, 8, bias=False, device="meta")
        worker = threading.Thread(
            target=_base().replace_direct_state_dict, args=(layer, _meta_state())
        )
        worker.start()
        worker.join()
    assert _base().replace_direct_state_dict is counted
    _base().replace_direct_state_dict(nn.Linear(4, 8, bias=False, device="meta"), _meta_state())
    assert calls == ["Linear", "Linear"]


# --- the plan updates against transformers' own ---


def _quantizer() -> Any:
    from transformers.quantizers.base import HfQuantizer

    class Quantizer(HfQuantizer):
        serialized_names = {"weight": ["weight", "weight_scale"]}

        def is_serializable(self) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return False

    return Quantizer(None)


def _experts() -> nn.Module:
    """Two layers whose experts hold their weights as parameters named in a plan, one with a
    scale beside it."""
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.empty(2, 4, 4, device="meta"))
    experts.gate_up_proj_scale = nn.Parameter(torch.empty(2, 4, 1, device="meta"))
    layer = nn.Module()
    layer.experts = experts
    layer.proj = nn.Linear(4, 4, device="meta")
    model = nn.Module()
    model.layers = nn.ModuleList([layer, copy.deepcopy(layer)])
    return model


@pytest.mark.parametrize(
    ("plan", "renamed"),
    [
        ({}, False),
        ({"layers.*.proj": "colwise"}, False),  # module names: no key to add
        ({"layers.*.experts.gate_up_proj": "grouped_gemm"}, True),  # its scale is added
        ({"layers.*.experts": "local"}, False),  # no parameter is named `experts_scale`
        # `gate_up_proj_scale` is a parameter's own name: transformers' method tells
        ({"gate_up_proj": "local"}, True),
    ],
)
def test_the_plans_are_what_transformers_makes_of_them(
    plan: dict[str, str], renamed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.quantizers.base import HfQuantizer

    quantizer, model = _quantizer(), _experts()
    want = dict(plan)
    HfQuantizer.update_parallel_plan(quantizer, model, want)
    calls = _counted(
        monkeypatch, "transformers.distributed.parallel_utils", "replace_layer_number_by_wildcard"
    )
    got = dict(plan)
    with _no_empty_plan_updates(quantizer):
        quantizer.update_parallel_plan(model, got)
    assert got == want
    assert bool(calls) == renamed
    assert "update_parallel_plan" not in vars(quantizer)


# --- the compression memo's key: a group's scheme serialized once while it is unchanged ---


def test_a_scheme_is_serialized_again_only_once_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from fastload.hf.meta_compression import compress_once_per_kind

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="int-quantized")
    serialized: list[str] = []
    function = QuantizationScheme.model_dump_json

    def counted(self: Any, *a: Any, **k: Any) -> str:
        serialized.append(self.weights.strategy)
        return function(self, *a, **k)

    monkeypatch.setattr(QuantizationScheme, "model_dump_json", counted)
    state = {
        "weight": torch.empty(8, 16, device="meta"),
        "weight_scale": torch.empty(8, 1, device="meta"),
    }
    with compress_once_per_kind() as memo:
        for _ in range(3):
            IntQuantizationCompressor.compress(dict(state), scheme)
        scheme.weights.strategy = "tensor"  # changed in place: a kind of its own
        state["weight_scale"] = torch.empty(1, device="meta")
        for _ in range(2):
            got = IntQuantizationCompressor.compress(dict(state), scheme)
    want = IntQuantizationCompressor.compress(dict(state), scheme)
    assert memo is not None and (memo.calls, memo.runs) == (5, 2)
    assert serialized == ["channel", "tensor"]
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {
        k: (v.shape, v.dtype) for k, v in want.items()
    }
