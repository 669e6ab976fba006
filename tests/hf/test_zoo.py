"""Model-zoo parity: fastload loads every zoo model type exactly as transformers does.

Each type of :func:`zoo_models.zoo_types` (transformers' own registries: text, vision, audio
and composite models) is built tiny with random weights, saved with transformers'
``save_pretrained``, then loaded by ``Cls.from_pretrained`` and by
``fastload.from_pretrained(Cls, dir)``; the two must raise the same error or give the same
tensor names, parameter/buffer roles, dtypes, bitwise values, tie groups, non-persistent
buffers, outputs and loading info (:mod:`zoo_compare`). A tensor transformers itself
initializes (missing from the checkpoint) is random on both sides, so it is compared on what
initialization fixes: constant values and zeroed (padding) rows.

The cells of a type: its main class's checkpoint in fp32, bf16 and fp16 (under
``dtype="auto"``), bf16 loaded as fp16, fp32 converted to bf16, and sharded; the base model's
checkpoint into the main class and back; the main class's checkpoint into every other class
registered for the type; for a composite type, its checkpoint into each sub-model's class and
each sub-model's checkpoint into the composite classes; and the fp32 load under
``fastload.patch_transformers()``, where transformers' contract rules outright. A documented
deliberate difference (:mod:`zoo_compare`) passes and is counted apart
(``conftest.zoo_summary``).

The pre-quantized formats fastload serves (docs/quantized.md) are cells too, each on the
direct API and under the patch: a tiny checkpoint of the format (:mod:`quantized_checkpoints`:
made by its own quantizer where that runs on a CPU, else written as transformers stores it)
loaded by transformers and by fastload and compared as any cell; they run by default (a
format whose package is missing is skipped; ``--zoo-types`` names them ``quantized-<id>``).

Only :data:`zoo_models.FAST_TYPES` run by default; the whole zoo runs with ``--zoo`` (or
``-m zoo``). A type that cannot be built tiny is skipped with the reason.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from zoo_compare import assert_loads_alike, load_pair  # noqa: E402
from zoo_models import (  # noqa: E402
    FAST_TYPES,
    NotTiny,
    ZooType,
    build,
    registered_classes,
    sub_config_keys,
    sub_model,
    tiny_config,
    zoo_type,
    zoo_types,
)

_ROOT = Path(tempfile.mkdtemp(prefix="fastload-zoo-"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The cells: every type under ``--zoo`` (or ``-m`` naming zoo), the fast subset otherwise
    (nothing else is even collected, so a default run stays lean)."""
    config = metafunc.config
    full = config.getoption("--zoo") or "zoo" in (config.getoption("markexpr") or "")
    types = zoo_types() if full else tuple(t for t in zoo_types() if t in FAST_TYPES)
    patterns = [p for p in config.getoption("--zoo-types").split(",") if p]
    if patterns:
        types = tuple(t for t in types if any(fnmatch.fnmatchcase(t, p) for p in patterns))

    def param(value: Any, model_type: str, id: str) -> Any:
        marks = () if model_type in FAST_TYPES else pytest.mark.zoo
        return pytest.param(value, id=id, marks=marks)

    if "zoo" in metafunc.fixturenames:
        metafunc.parametrize("zoo", [param(t, t, t) for t in types])
    if "zoo_class" in metafunc.fixturenames:
        cells = [(t, c) for t in types for c in registered_classes(t)]
        metafunc.parametrize("zoo_class", [param(c, c[0], f"{c[0]}-{c[1]}") for c in cells])
    if "zoo_sub" in metafunc.fixturenames:
        cells = [(t, k) for t in types for k in sub_config_keys(t)]
        metafunc.parametrize("zoo_sub", [param(c, c[0], f"{c[0]}-{c[1]}") for c in cells])
    if "quantized" in metafunc.fixturenames:  # by default; --zoo-types: those it names
        names = [n for n in QUANTIZED if not patterns or _named(f"quantized-{n}", patterns)]
        metafunc.parametrize("quantized", names)


def _named(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    logging.getLogger("fastload").setLevel(logging.ERROR)
    yield
    transformers.logging.set_verbosity(level)
    logging.getLogger("fastload").setLevel(logging.NOTSET)


@pytest.fixture
def cell(request: pytest.FixtureRequest, record_property: Any) -> Any:
    """Records the cell's type, and returns the recorder of its documented differences."""
    params = request.node.callspec.params
    value = params.get("zoo") or params.get("zoo_class") or params.get("zoo_sub")
    if "quantized" in params:  # a pre-quantized format's cell: its own row
        value = f"quantized {params['quantized']}"
    record_property("zoo_type", value if isinstance(value, str) else value[0])

    def differences(found: list[str]) -> None:
        for text in found:
            record_property("zoo_difference", text)

    return differences


def resolved(model_type: str) -> ZooType:
    try:
        return zoo_type(model_type)
    except NotTiny as e:
        pytest.skip(f"{model_type}: {e}")


def _saved_model(model_type: str, variant: str, sub: str | None = None) -> torch.nn.Module:
    """The model a checkpoint of the type is saved from (seeded: the same on every call)."""
    zoo = zoo_type(model_type)
    config = tiny_config(model_type)
    if sub is not None:
        return build(sub_model(model_type, sub), getattr(config, sub))
    if variant == "base":
        if zoo.base is None:
            raise NotTiny(f"no base model class takes the {model_type} config")
        return build(zoo.base, config, seed=1)
    model = build(zoo.head, config)
    if variant in ("bf16", "fp16"):
        model = model.to(torch.bfloat16 if variant == "bf16" else torch.float16)
    return model


@functools.cache
def _saved(model_type: str, variant: str, sub: str | None = None) -> Path | NotTiny:
    """A checkpoint of the type: ``head``/``base`` (fp32), ``bf16``/``fp16`` (the main class
    converted before saving), ``sharded`` (fp32 in small shards); with ``sub``, the checkpoint
    of that sub-config's model class."""
    try:
        model = _saved_model(model_type, variant, sub)
    except NotTiny as e:
        e.__context__ = e.__cause__ = None  # their frames hold models
        return e.with_traceback(None)
    kwargs: dict[str, Any] = {}
    if variant == "sharded":
        kwargs["max_shard_size"] = "20KB"
    directory = _ROOT / model_type / (variant if sub is None else f"sub-{sub}")
    try:
        model.save_pretrained(directory, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers cannot save its own model
        return NotTiny(f"save_pretrained fails: {type(e).__name__}: {str(e)[:200]}")
    return directory


def saved_model(model_type: str, variant: str = "head", sub: str | None = None) -> Any:
    """A builder of the model the checkpoint was saved from, to check a tensor against."""
    return functools.partial(_saved_model, model_type, variant, sub)


def checkpoint(model_type: str, variant: str = "head", sub: str | None = None) -> Path:
    found = _saved(model_type, variant, sub)
    if isinstance(found, NotTiny):
        pytest.skip(f"{model_type}: {found}")
    return found


def check(cell: Any, class_name: str, directory: Path, saved: Any = None, **kwargs: Any) -> None:
    ours, theirs = load_pair(class_name, directory, **kwargs)
    cell(assert_loads_alike(ours, theirs, saved=saved))


@pytest.mark.parametrize(
    "variant, kwargs",
    [
        pytest.param("head", {}, id="fp32"),
        pytest.param("bf16", {"dtype": "auto"}, id="bf16-auto"),
        pytest.param("fp16", {"dtype": "auto"}, id="fp16-auto"),
        pytest.param("bf16", {"dtype": torch.float16}, id="bf16-as-fp16"),
        pytest.param("head", {"dtype": torch.bfloat16}, id="fp32-as-bf16"),
        pytest.param("sharded", {}, id="sharded"),
    ],
)
def test_checkpoint_of_the_main_class_loads_like_transformers(
    zoo: str, variant: str, kwargs: dict[str, Any], cell: Any
) -> None:
    check(cell, resolved(zoo).head, checkpoint(zoo, variant), saved_model(zoo, variant), **kwargs)


def test_base_checkpoint_loads_into_the_head_class_like_transformers(zoo: str, cell: Any) -> None:
    check(cell, resolved(zoo).head, checkpoint(zoo, "base"), saved_model(zoo, "base"))


def test_head_checkpoint_loads_into_the_base_class_like_transformers(zoo: str, cell: Any) -> None:
    base = resolved(zoo).base
    if base is None:
        pytest.skip(f"{zoo}: no base model class takes the {zoo} config")
    check(cell, base, checkpoint(zoo), saved_model(zoo))


def test_head_checkpoint_loads_into_every_class_of_the_type_like_transformers(
    zoo_class: tuple[str, str], cell: Any
) -> None:
    model_type, class_name = zoo_class
    zoo = resolved(model_type)
    if class_name in (zoo.head, zoo.base):
        pytest.skip(f"{class_name} is the type's main or base class (the cells above)")
    directory = checkpoint(model_type)
    try:
        build(class_name, tiny_config(model_type))
    except NotTiny as e:
        pytest.skip(f"{model_type}: {e}")
    check(cell, class_name, directory, saved_model(model_type))


def test_composite_checkpoint_loads_into_its_sub_model_class_like_transformers(
    zoo_sub: tuple[str, str], cell: Any
) -> None:
    model_type, key = zoo_sub
    resolved(model_type)
    directory = checkpoint(model_type)
    try:
        sub_class = sub_model(model_type, key)
        build(sub_class, getattr(tiny_config(model_type), key))
    except NotTiny as e:
        pytest.skip(f"{model_type}: {e}")
    check(cell, sub_class, directory, saved_model(model_type))


@pytest.mark.parametrize("target", ["head", "base"])
def test_sub_model_checkpoint_loads_into_the_composite_class_like_transformers(
    zoo_sub: tuple[str, str], target: str, cell: Any
) -> None:
    model_type, key = zoo_sub
    zoo = resolved(model_type)
    class_name = zoo.head if target == "head" else zoo.base
    if class_name is None or (target == "base" and class_name == zoo.head):
        pytest.skip(f"{model_type}: no base class apart from {zoo.head}")
    checkpoint(model_type)  # the composite model is tiny
    directory = checkpoint(model_type, sub=key)
    # the sub-model's config.json does not say the composite's sizes: the caller gives them
    saved = saved_model(model_type, "", key)
    check(cell, class_name, directory, saved, config=tiny_config(model_type))


@pytest.mark.usefixtures("unpatched")
@pytest.mark.parametrize(
    "variant, kwargs",
    [pytest.param("head", {}, id="fp32"), pytest.param("bf16", {"dtype": "auto"}, id="bf16-auto")],
)
def test_checkpoint_loads_under_the_patch_exactly_like_transformers(
    zoo: str, variant: str, kwargs: dict[str, Any], cell: Any
) -> None:
    ours, theirs = load_pair(resolved(zoo).head, checkpoint(zoo, variant), patched=True, **kwargs)
    if not ours.served:
        pytest.skip(f"{zoo}: the patch leaves this load to transformers")
    cell(assert_loads_alike(ours, theirs, patched=True))


def _compressed_tensors_formats() -> list[tuple[str, Any, str]]:
    from quantized_checkpoints import COMPRESSED_TENSORS_FORMATS

    return COMPRESSED_TENSORS_FORMATS


def _compressed_tensors(directory: Path, *, scheme: Any, form: str, dequantize: bool) -> Path:
    """compressed-tensors' checkpoint of ``form``; ``dequantize``: its config asks transformers
    to dequantize it on load (``CompressedTensorsDequantize``)."""
    import json

    from quantized_checkpoints import compressed_tensors_checkpoint

    directory.mkdir(parents=True)
    compressed_tensors_checkpoint(directory, scheme, form)
    if dequantize:
        config = json.loads((directory / "config.json").read_text())
        config["quantization_config"]["dequantize"] = True
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _fp8(directory: Path) -> Path:
    from quantized_checkpoints import fp8_checkpoint

    return fp8_checkpoint(directory)


def _mxfp4(directory: Path) -> Path:
    from quantized_checkpoints import mxfp4_checkpoint

    return mxfp4_checkpoint(directory)


def _bnb(directory: Path, *, arguments: dict[str, Any]) -> Path:
    from quantized_checkpoints import bnb_checkpoint

    return bnb_checkpoint(directory, arguments)


def _torchao(directory: Path, *, config_name: str) -> Path:
    from quantized_checkpoints import torchao_checkpoint

    return torchao_checkpoint(directory, config_name)


def _gptq_awq(directory: Path, *, method: str) -> Path:
    from quantized_checkpoints import gptq_awq_checkpoint

    if method == "gptq":  # transformers' GPTQ quantizer is optimum's
        pytest.importorskip("optimum")
    return gptq_awq_checkpoint(directory, method)


#: the pre-quantized formats fastload serves, by cell id: (the package the format needs, the
#: class its checkpoint loads into, the maker of its checkpoint in a directory)
QUANTIZED: dict[str, tuple[str, str, Any]] = {
    **{
        f"compressed-tensors-{name}{'-dequantized' if dequantize else ''}": (
            "compressed_tensors",
            "LlamaForCausalLM",
            functools.partial(_compressed_tensors, scheme=scheme, form=form, dequantize=dequantize),
        )
        for name, scheme, form in _compressed_tensors_formats()
        for dequantize in (False, True)
    },
    "fp8-dequantized": ("accelerate", "LlamaForCausalLM", _fp8),
    "mxfp4-dequantized": ("transformers", "GptOssForCausalLM", _mxfp4),
    **{
        f"bitsandbytes-{name}": (
            "bitsandbytes",
            "LlamaForCausalLM",
            functools.partial(_bnb, arguments=arguments),
        )
        for name, arguments in (
            ("nf4", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
            ("fp4", {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
            (
                "nf4-double",
                {
                    "load_in_4bit": True,
                    "bnb_4bit_quant_type": "nf4",
                    "bnb_4bit_use_double_quant": True,
                },
            ),
            ("int8", {"load_in_8bit": True}),
        )
    },
    **{
        method: ("gptqmodel", "LlamaForCausalLM", functools.partial(_gptq_awq, method=method))
        for method in ("gptq", "awq")
    },
    **{
        f"torchao-{name}": (
            "torchao",
            "LlamaForCausalLM",
            functools.partial(_torchao, config_name=config_name),
        )
        for name, config_name in (
            ("int8-weight-only", "Int8WeightOnlyConfig"),
            ("int8-dynamic-activation", "Int8DynamicActivationInt8WeightConfig"),
            ("float8-weight-only", "Float8WeightOnlyConfig"),
        )
    },
}


@functools.cache
def _quantized(name: str) -> Path:
    package, _, make = QUANTIZED[name]
    pytest.importorskip(package)
    return make(_ROOT / "quantized" / name)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("unpatched")
@pytest.mark.parametrize("patched", [False, True], ids=["direct", "patched"])
def test_a_pre_quantized_checkpoint_loads_like_transformers(
    quantized: str, patched: bool, cell: Any
) -> None:
    package, class_name, _ = QUANTIZED[quantized]
    pytest.importorskip(package)
    ours, theirs = load_pair(class_name, _quantized(quantized), patched=patched)
    assert theirs.error is None, f"transformers cannot load it here: {theirs.error}"
    if patched:
        assert ours.served, "the patch left this load to transformers"
    cell(assert_loads_alike(ours, theirs, patched=patched))
