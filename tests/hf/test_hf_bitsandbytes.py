"""bitsandbytes' pre-quantized checkpoints (``quant_method: bitsandbytes``: 4-bit nf4 and fp4,
with and without double quantization, and 8-bit LLM.int8) on the CPU, which transformers loads
through bitsandbytes' CPU backend by deserializing them (``Bnb4bitDeserialize``,
``Bnb8bitDeserialize``: the packed weight and its quant state made into bitsandbytes'
``Params4bit`` / ``Int8Params``): fastload reads the stored tensors, runs transformers' own
operation on them (:mod:`fastload.hf.load_ops`) and the model is transformers' own: the same
``Linear4bit`` / ``Linear8bitLt`` modules, the same parameters and quant states bitwise, the
same logits, ``hf_quantizer`` and ``save_pretrained`` files. The checkpoints are tiny Llamas
quantized by transformers' own ``BitsAndBytesConfig`` on the CPU and saved by its
``save_pretrained``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
bnb = pytest.importorskip("bitsandbytes")

from quantized_checkpoints import (  # noqa: E402
    assert_saves_alike,
    bnb_checkpoint,
    operation_order,
    patched_and_transformers,
    rewritten,
)
from tensor_samples import raw_bytes  # noqa: E402

import fastload  # noqa: E402
from fastload.hf import patch  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched")

#: (id, BitsAndBytesConfig's arguments)
FORMATS: list[tuple[str, dict[str, Any]]] = [
    ("nf4", {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    ("fp4", {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
    (
        "nf4-double",
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
    ),
    ("int8", {"load_in_8bit": True}),
]
PROJ = "model.layers.1.mlp.down_proj"


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    # bitsandbytes' CPU backend says on every 4-bit forward that it has no hub kernel, and its
    # 8-bit matmul that it casts bf16 inputs to fp16
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    yield
    logging.getLogger("bitsandbytes").setLevel(logging.NOTSET)


@pytest.fixture(scope="module", params=FORMATS, ids=[f[0] for f in FORMATS])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, arguments = request.param
    return bnb_checkpoint(tmp_path_factory.mktemp(name), arguments)


def _transformers(directory: Path, **kwargs: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, **kwargs)


def _quant_state(param: torch.Tensor) -> dict[str, Any]:
    """What a bitsandbytes parameter holds beside its data: a 4-bit one's quant state (as
    bitsandbytes serializes it, tensors as bytes), an 8-bit one's ``SCB``/``CB``."""

    def plain(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.dtype, tuple(value.shape), raw_bytes(value).numpy().tobytes()

    state = getattr(param, "quant_state", None)
    if state is not None:
        return {k: plain(v) for k, v in state.as_dict(packed=False).items()}
    return {name: plain(getattr(param, name, None)) for name in ("SCB", "CB", "has_fp16_weights")}


def assert_same_bnb_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Module classes, parameters (their classes and quant states too) and buffers bitwise,
    ``hf_quantizer``, the config's quantization config, and the logits of a fixed input."""
    assert [type(m) for m in got.modules()] == [type(m) for m in want.modules()]
    for kind in ("named_parameters", "named_buffers"):
        got_tensors, want_tensors = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert list(got_tensors) == list(want_tensors), kind
        for name, w in want_tensors.items():
            g = got_tensors[name]
            assert type(g) is type(w), name
            assert (g.dtype, g.shape, g.requires_grad) == (w.dtype, w.shape, w.requires_grad), name
            assert torch.equal(raw_bytes(g.detach()), raw_bytes(w.detach())), name
            assert _quant_state(g) == _quant_state(w), name
    assert type(got.hf_quantizer) is type(want.hf_quantizer)
    assert got.config.quantization_config.to_dict() == want.config.quantization_config.to_dict()
    for flag in ("is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit", "quantization_method"):
        assert getattr(got, flag, None) == getattr(want, flag, None), flag
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize(
    ("read_mode", "dtype"), [("pread", None), ("mmap", None), ("mmap", torch.float16)]
)
def test_a_bitsandbytes_checkpoint_loads_as_transformers_loads_it(
    quantized: Path, read_mode: str, dtype: torch.dtype | None
) -> None:
    """In another dtype too: transformers' deserializer passes the tensors it collects alone
    (embeddings, norms, the head: every ``weight``) through uncast, so they keep the stored
    bf16 while the biases and the rest take the dtype asked for; fastload runs the same."""
    options = {} if dtype is None else {"dtype": dtype}
    want = _transformers(quantized, **options)
    got, report = fastload.from_pretrained(
        quantized, read_mode=read_mode, output_loading_info=True, **options
    )
    assert got.model.embed_tokens.weight.dtype == torch.bfloat16
    assert report.quant_method == "bitsandbytes" and report.quant_seconds > 0
    assert "quantized: bitsandbytes" in report.summary()
    assert not report.missing and not report.unexpected and not report.mismatched
    assert not report.authorized_unexpected  # every quant state tensor was used
    assert isinstance(got.model.layers[0].mlp.up_proj, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    assert_same_bnb_model(got, want)


def test_device_map_auto_on_a_machine_without_a_gpu_loads_as_transformers_loads_it(
    quantized: Path,
) -> None:
    """What bitsandbytes users pass: ``device_map="auto"``. Without a GPU every planner puts the
    whole model on the CPU, so fastload loads it there, as transformers does."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU, 'auto' may spread the model over several devices")
    want = _transformers(quantized, device_map="auto")
    got, report = fastload.from_pretrained(quantized, device_map="auto", output_loading_info=True)
    assert report.quant_method == "bitsandbytes" and report.device == "cpu"
    assert_same_bnb_model(got, want)


def test_the_operations_run_in_the_order_of_the_file_one_at_a_time(
    quantized: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.integrations import bitsandbytes as integration

    operation = (
        integration.Bnb8bitDeserialize
        if "int8" in str(quantized)
        else integration.Bnb4bitDeserialize
    )
    done = operation_order(quantized, operation, monkeypatch)
    assert len(done) == 14  # 7 projections of 2 layers
    for names, target in done:
        module = target.removesuffix(".weight")
        assert target in names and all(n.startswith(module + ".") for n in names)
        assert len(names) >= 2  # the weight and its quant state


def test_under_the_patch_a_bitsandbytes_checkpoint_is_read_by_fastload(
    quantized: Path, transformers_loads: list[str]
) -> None:
    got, want = patched_and_transformers(quantized, "bitsandbytes", transformers_loads)
    assert_same_bnb_model(got, want)
    if not torch.cuda.is_available():  # "auto" is the CPU here (test above)
        got, want = patched_and_transformers(
            quantized, "bitsandbytes", transformers_loads, device_map="auto"
        )
        assert_same_bnb_model(got, want)


def test_save_pretrained_writes_the_checkpoint_transformers_wrote(
    quantized: Path, tmp_path: Path
) -> None:
    """fastload's model saves byte for byte the checkpoint transformers saved of the model it
    quantized. transformers 5.25 cannot save the model it loaded from that checkpoint (its
    ``Bnb4bitDeserialize``/``Bnb8bitDeserialize`` have no reverse operation: the
    ``NotImplementedError`` below); where it can, both must write the same files."""
    got = fastload.from_pretrained(quantized)
    got.save_pretrained(tmp_path / "fastload")
    names = sorted(p.name for p in quantized.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fastload").iterdir())
    for name in names:
        assert (tmp_path / "fastload" / name).read_bytes() == (quantized / name).read_bytes(), name
    want = _transformers(quantized)
    try:
        want.save_pretrained(tmp_path / "transformers")
    except NotImplementedError:
        return  # transformers' own limitation (docs/quantized.md)
    assert_saves_alike(got, want, tmp_path / "both")


def test_a_model_made_by_a_load_operation_is_not_reloaded(quantized: Path) -> None:
    model = fastload.from_pretrained(quantized)
    with pytest.raises(fastload.UnsupportedError, match="load operation"):
        fastload.reload(model, quantized)


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The checkpoint of one format by its id, made once per module."""
    made: dict[str, Path] = {}

    def of(name: str) -> Path:
        if name not in made:
            made[name] = bnb_checkpoint(tmp_path_factory.mktemp(name), dict(FORMATS)[name])
        return made[name]

    return of


def _set(name: str, make):  # type: ignore[no-untyped-def]
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = make(tensors[name]).contiguous()

    return change


W = f"{PROJ}.weight"


@pytest.mark.parametrize(
    ("form", "change", "error", "message"),
    [
        pytest.param(
            "nf4",
            lambda t: t.pop(f"{W}.absmax"),
            fastload.CheckpointError,
            rf"'{W}' is quantized \(U8\) but its scale '{W}.absmax' is missing",
            id="nf4-absmax-missing",
        ),
        pytest.param(
            "nf4",
            lambda t: t.pop(f"{W}.quant_map"),
            fastload.CheckpointError,
            rf"'{W}' is quantized \(U8\) but '{W}.quant_map' \(bitsandbytes' nf4 quant state\) "
            "is missing",
            id="nf4-quant-map-missing",
        ),
        pytest.param(
            "fp4",
            lambda t: t.pop(f"{W}.quant_state.bitsandbytes__fp4"),
            fastload.CheckpointError,
            rf"but '{W}.quant_state.bitsandbytes__fp4' \(bitsandbytes' fp4 quant state\)",
            id="fp4-quant-state-missing",
        ),
        pytest.param(
            "nf4-double",
            lambda t: t.pop(f"{W}.nested_absmax"),
            fastload.CheckpointError,
            rf"but '{W}.nested_absmax' \(bitsandbytes' nf4 quant state\) is missing",
            id="nested-absmax-missing",
        ),
        pytest.param(
            "nf4",
            _set(W, lambda w: w[:100]),
            fastload.ModelMismatchError,
            rf"tensor '{W}' has shape \[100, 1\]; the nf4 weight of the model's '{W}' \[64, 128\] "
            r"\(4096 bytes\) has shape \[4096, 1\]",
            id="nf4-packed-size",
        ),
        pytest.param(
            "nf4",
            _set(f"{W}.absmax", lambda a: a[:10]),
            fastload.ModelMismatchError,
            rf"tensor '{W}.absmax' has shape \[10\]; .* \(shape \[128\] for bitsandbytes' blocks",
            id="nf4-absmax-shape",
        ),
        pytest.param(
            "nf4",
            _set(f"{W}.absmax", lambda a: a.half()),
            fastload.CheckpointError,
            rf"tensor '{W}.absmax' has dtype F16; the absmax .* is stored as F32",
            id="nf4-absmax-dtype",
        ),
        pytest.param(
            "int8",
            lambda t: t.pop(f"{PROJ}.SCB"),
            fastload.CheckpointError,
            rf"'{W}' is quantized \(I8\) but its scale '{PROJ}.SCB' is missing",
            id="int8-scb-missing",
        ),
        pytest.param(
            "int8",
            _set(f"{PROJ}.SCB", lambda s: s[:3]),
            fastload.ModelMismatchError,
            rf"tensor '{PROJ}.SCB' has shape \[3\]; .* has shape \[64\]",
            id="int8-scb-shape",
        ),
        pytest.param(
            "int8",
            _set(W, lambda w: w[:3]),
            fastload.ModelMismatchError,
            rf"tensor '{W}' has shape \[3, 128\]; the LLM.int8 weight .* has shape \[64, 128\]",
            id="int8-weight-shape",
        ),
        pytest.param(
            "int8",
            _set(W, lambda w: w.to(torch.int16)),
            fastload.CheckpointError,
            rf"tensor '{W}' has dtype I16; the LLM.int8 weight .* is stored as I8",
            id="int8-weight-dtype",
        ),
    ],
)
def test_a_bad_quant_state_is_refused_naming_it_before_reading(
    checkpoint_of: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    form: str,
    change,  # type: ignore[no-untyped-def]
    error: type[Exception],
    message: str,
) -> None:
    """Checked from the headers: no operation runs. Where transformers raises (a missing
    tensor, a wrong shape) it is its ``RuntimeError`` after the read; ``ModelMismatchError`` is
    one. A wrong dtype transformers casts silently; fastload refuses it by name."""
    from transformers.integrations import bitsandbytes as integration

    directory = rewritten(checkpoint_of(form), tmp_path, change)
    ran: list[str] = []
    for operation in (integration.Bnb4bitDeserialize, integration.Bnb8bitDeserialize):
        monkeypatch.setattr(operation, "convert", lambda self, d, **k: ran.append("ran"))
    with pytest.raises(error, match=message):
        fastload.from_pretrained(directory)
    assert ran == []


def test_an_unquantized_checkpoint_under_a_bitsandbytes_config_is_refused_naming_it(
    checkpoint_of: Any, tmp_path: Path
) -> None:
    """A checkpoint whose config says bitsandbytes but whose weights were saved before
    quantizing (no quant state): transformers puts the float weights into the quantized
    modules as they are; fastload refuses it by name from the headers."""
    quantized = checkpoint_of("int8")
    directory = tmp_path / "unquantized"
    directory.mkdir()
    for f in (quantized.parent / "bf16").iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = json.loads((quantized / "config.json").read_text())[
        "quantization_config"
    ]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        fastload.CheckpointError,
        match=r"'(model\.layers\.\d\.\w+\.\w+_proj)\.weight' is stored unquantized \(BF16\).*"
        r"'\1\.SCB', which is missing",
    ):
        fastload.from_pretrained(directory)


def test_a_tied_model_in_another_dtype_is_refused_naming_the_tensor(
    tmp_path_factory: pytest.TempPathFactory, transformers_loads: list[str]
) -> None:
    """transformers keeps the tied embeddings in their stored dtype (its deserializer passes them
    through uncast); fastload does not run that on a tied tensor: refused by name, and under the
    patch transformers loads it."""
    directory = bnb_checkpoint(tmp_path_factory.mktemp("tied"), dict(FORMATS)["nf4"], tied=True)
    assert fastload.from_pretrained(directory).lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(
        fastload.UnsupportedError,
        match=r"keeps 'model\.embed_tokens\.weight' in its stored BF16 .* ties it",
    ):
        fastload.from_pretrained(directory, dtype=torch.float16)
    transformers_loads.clear()
    with fastload.patch_transformers():
        model = _transformers(directory, dtype=torch.float16)
    assert transformers_loads == ["LlamaForCausalLM"] and patch.last_report is None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
