"""Tiny pre-quantized checkpoints, of each format fastload serves (docs/quantized.md), and the
comparisons of a loaded model with transformers'.

Made by the format's own quantizer where it runs on a CPU:

* :func:`compressed_tensors_checkpoint`: a Llama (or Mixtral) quantized weight-only by
  compressed-tensors' own code and saved as llm-compressor saves one;
* :func:`bnb_checkpoint`: a Llama quantized on load by transformers' bitsandbytes quantizer
  and saved by its ``save_pretrained``.
* :func:`torchao_checkpoint`: a Llama quantized on load by transformers' torchao quantizer
  (``TorchAoConfig``) and saved by its ``save_pretrained`` (torchao's safetensors layout).
* :func:`gptq_awq_checkpoint`: a Llama in GPTQ's or AWQ's 4-bit layout, written by
  :func:`vllm_models.quantize` (random packed words: the layout is what a loader is tested on).

Written as transformers' quantizers store them where those need a GPU, or the hub's kernels, to
quantize (the formats transformers dequantizes on load on a machine without a GPU): the model
is built and saved by transformers, then its quantized tensors are replaced by their stored form
and the config gets the quantization_config transformers writes.

* :func:`fp8_checkpoint`: a Llama whose projections are FP8 e4m3 per 128x128 block, with
  float32 inverse scales ``weight_scale_inv`` ``[ceil(out/128), ceil(in/128)]``
  (``quant_method: fp8``, transformers' ``Fp8Dequantize``).
* :func:`mxfp4_checkpoint`: a gpt-oss whose experts are MXFP4 as OpenAI's gpt-oss checkpoints
  store them (``quant_method: mxfp4``, transformers' ``Mxfp4Dequantize``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from tensor_samples import raw_bytes

FP8_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "modules_to_not_convert": None,
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
#: the quantization_config of openai/gpt-oss-20b
MXFP4_QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
#: the FP4 (e2m1) value of each 4-bit code, as transformers' FP4_VALUES
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in e4m3 per 128x128 block, and the float32 inverse scale of each block."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / 128), math.ceil(cols / 128))
    blocks = weight.float().reshape(grid[0], 128, grid[1], 128)
    inverse = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    values = (blocks / inverse[:, None, :, None]).clamp(-448, 448).reshape(rows, cols)
    return values.to(torch.float8_e4m3fn), inverse


def mxfp4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert tensor as gpt-oss holds it (``[experts, cols, rows]``) in MXFP4 as its
    checkpoints store it, the layout transformers' ``Mxfp4Dequantize`` reads: each row's values
    in groups of 32, one power-of-two scale per group stored as its exponent plus 127 (``uint8``
    ``[experts, rows, cols/32]``), the values as FP4 codes (nearest of :data:`FP4_VALUES` after
    the scale), two to a byte, the even one in the low nibble (``uint8``
    ``[experts, rows, cols/32, 16]``). transformers unpacks the rows and transposes them back."""
    rows_first = weight.float().transpose(1, 2)  # [experts, rows, cols]
    experts, rows, cols = rows_first.shape
    groups = rows_first.reshape(experts, rows, cols // 32, 32)
    exponent = (
        torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100))) - 2
    )  # 6 = 1.5 * 4
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


#: the tiny decoder every checkpoint here is made of (sizes given per maker)
TINY = dict(
    vocab_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    dtype="bfloat16",
)


def tiny_llama(hidden: int, intermediate: int, *, tied: bool = False) -> torch.nn.Module:
    """A seeded tiny bf16 Llama (``tied``: its head tied to its embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **TINY, hidden_size=hidden, intermediate_size=intermediate, tie_word_embeddings=tied
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _quantized_on_load(directory: Path, model: torch.nn.Module, settings: Any) -> Path:
    """``model`` saved into ``directory / "bf16"``, quantized on load by transformers with the
    quantization config ``settings`` and saved by its ``save_pretrained`` into
    ``directory / "quantized"``."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(directory / "bf16")
    made = AutoModelForCausalLM.from_pretrained(directory / "bf16", quantization_config=settings)
    made.save_pretrained(directory / "quantized")
    return directory / "quantized"


def _store(directory: Path, model: torch.nn.Module, quantize: Any, quantization: dict) -> Path:
    import safetensors.torch as st

    model.save_pretrained(directory)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensors.update(quantize(name, tensor) or {name: tensor.contiguous()})
    st.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def fp8_checkpoint(directory: Path) -> Path:
    """A tiny bf16 Llama whose projections are stored in FP8 blocks (the sizes multiples of
    128: transformers' dequantize needs whole blocks), with transformers' quantization_config."""
    model = tiny_llama(256, 384)

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not name.endswith("proj.weight"):
            return None
        weight, scale = fp8_blocks(tensor)
        return {name: weight, name + "_scale_inv": scale}

    return _store(directory, model, quantize, FP8_QUANTIZATION)


def mxfp4_checkpoint(directory: Path) -> Path:
    """A tiny bf16 gpt-oss (2 layers of 4 experts, sizes multiples of 32) whose experts'
    ``gate_up_proj`` and ``down_proj`` are stored as ``<proj>_blocks`` and ``<proj>_scales``
    (their biases, attention, router, norms and embeddings in bf16, as gpt-oss stores them),
    with gpt-oss' quantization_config."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        dtype="bfloat16",
    )
    model = GptOssForCausalLM(config).to(torch.bfloat16)

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            return None
        blocks, scales = mxfp4_blocks(tensor)
        return {name + "_blocks": blocks, name + "_scales": scales}

    return _store(directory, model, quantize, MXFP4_QUANTIZATION)


#: (id, the weights' scheme, compressed-tensors format): a compressed-tensors preset, or (value
#: type, bits) per output channel. int8 and FP8 (e4m3) are stored as is, int4 packed eight to an
#: int32, NVFP4 and MXFP4 two to a uint8 beside FP8 (NVFP4, with a global scale) or E8M0 scales
#: per group of 16 or 32
COMPRESSED_TENSORS_FORMATS: list[tuple[str, str | tuple[str, int], str]] = [
    ("int8", ("int", 8), "int-quantized"),
    ("int4-packed", ("int", 4), "pack-quantized"),
    ("fp8", ("float", 8), "float-quantized"),
    ("nvfp4", "NVFP4A16", "nvfp4-pack-quantized"),
    ("mxfp4", "MXFP4A16", "mxfp4-pack-quantized"),
]


def compressed_tensors_checkpoint(
    directory: Path,
    scheme: str | tuple[str, int] = ("int", 8),
    form: str = "int-quantized",
    moe: bool = False,
    other: tuple[str, dict[str, Any]] | None = None,
) -> Path:
    """A tiny Llama (``moe``: Mixtral) whose Linear layers but the head compressed-tensors
    quantized weight-only by ``scheme`` (symmetric; ``other``: a module name pattern and the
    changes to the scheme's arguments its layers are quantized with instead, in a group of their
    own), compressed in its format ``form`` and saved as llm-compressor saves one."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import MixtralConfig, MixtralForCausalLM

    if moe:
        torch.manual_seed(0)
        sizes = dict(TINY, hidden_size=64, intermediate_size=128)
        config: Any = MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
        model = MixtralForCausalLM(config).to(torch.bfloat16)
    else:
        model = tiny_llama(64, 128)
    if isinstance(scheme, str):
        weights = preset_name_to_scheme(scheme, ["Linear"])
    else:
        kind, bits = scheme
        args = QuantizationArgs(num_bits=bits, type=kind, symmetric=True, strategy="channel")
        weights = QuantizationScheme(targets=["Linear"], weights=args)
    groups = {"group_0": weights}
    if other is not None:
        pattern, changes = other
        args = weights.weights.model_copy(update=changes)
        groups["group_1"] = QuantizationScheme(targets=[f"re:{pattern}"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _calibrate(module, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


def _calibrate(module: torch.nn.Module, args: Any) -> None:
    """What a calibration of the weights computes: the scales (and zero points, global scale)
    of their ranges, per output channel or per group."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    w = module.weight.detach().float()
    if args.group_size:
        groups = w.reshape(w.shape[0], -1, args.group_size)
        low, high = groups.amin(-1), groups.amax(-1)
    else:
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    whole = None
    if hasattr(module, "weight_global_scale"):
        whole = generate_gparam(w.amin(), w.amax())
        module.weight_global_scale.data.copy_(whole.reshape(module.weight_global_scale.shape))
    scale, zero = calculate_qparams(low, high, args, global_scale=whole)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def bnb_checkpoint(directory: Path, arguments: dict[str, Any], *, tied: bool = False) -> Path:
    """A tiny bf16 Llama quantized on load by transformers' bitsandbytes quantizer (every
    Linear but the head; ``arguments``: ``BitsAndBytesConfig``'s) and saved by its
    ``save_pretrained`` into ``directory / "quantized"`` (the bf16 model in ``"bf16"``);
    ``tied``: its head tied to its embeddings."""
    from transformers import BitsAndBytesConfig

    settings = BitsAndBytesConfig(**arguments, bnb_4bit_compute_dtype=torch.bfloat16)
    return _quantized_on_load(directory, tiny_llama(64, 128, tied=tied), settings)


def torchao_checkpoint(directory: Path, config_name: str) -> Path:
    """A tiny bf16 Llama quantized on load by transformers' torchao quantizer with torchao's
    ``config_name`` (``Int8WeightOnlyConfig``, ``Float8WeightOnlyConfig``, ...; every Linear but
    the head) and saved by its ``save_pretrained`` into ``directory / "quantized"``."""
    import torchao.quantization as tq
    from transformers import TorchAoConfig

    settings = TorchAoConfig(getattr(tq, config_name)())
    return _quantized_on_load(directory, tiny_llama(64, 128), settings)


def gptq_awq_checkpoint(directory: Path, method: str) -> Path:
    """A tiny bf16 Llama (inputs of 128 and 256: whole groups of 128) written by
    :func:`vllm_models.quantize` as a ``method`` (``gptq`` or ``awq``) checkpoint into
    ``directory / "quantized"``: every decoder projection packed as the method stores it
    (``qweight``, ``qzeros`` int32, ``scales`` float16, GPTQ's ``g_idx``), float16 elsewhere,
    with the method's quantization_config (4 bits, groups of 128)."""
    from vllm_models import quantize

    tiny_llama(128, 256).save_pretrained(directory / "bf16")
    return quantize(directory / "bf16", directory / "quantized", method)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 17, 33]])).logits  # type: ignore[no-any-return]


def assert_same_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Module classes, parameters and buffers (names, dtypes, shapes, bytes, trainability),
    what transformers' quantizer leaves on the model, and the logits of a fixed input."""
    assert [type(m) for m in got.modules()] == [type(m) for m in want.modules()]
    for kind in ("named_parameters", "named_buffers"):
        got_tensors, want_tensors = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert list(got_tensors) == list(want_tensors), kind
        for name, w in want_tensors.items():
            g = got_tensors[name]
            assert (g.dtype, g.shape, g.requires_grad) == (w.dtype, w.shape, w.requires_grad), name
            assert torch.equal(raw_bytes(g.detach()), raw_bytes(w.detach())), name
    # a dequantized model is transformers' unquantized one: its quantizer's postprocess_model
    # removes hf_quantizer and the quantization config
    for attribute in ("hf_quantizer", "is_quantized", "quantization_method"):
        assert hasattr(got, attribute) == hasattr(want, attribute), attribute
        assert getattr(got, attribute, None) == getattr(want, attribute, None), attribute
    assert hasattr(got.config, "quantization_config") == hasattr(want.config, "quantization_config")
    assert got.training == want.training
    assert torch.equal(_logits(got), _logits(want))


def assert_saves_alike(got: torch.nn.Module, want: torch.nn.Module, directory: Path) -> None:
    """``save_pretrained`` of ``got`` writes what it writes of ``want``: the same file names,
    the same bytes in each (tensors, config, generation config)."""
    want.save_pretrained(directory / "transformers")
    got.save_pretrained(directory / "fastload")
    names = sorted(p.name for p in (directory / "transformers").iterdir())
    assert names == sorted(p.name for p in (directory / "fastload").iterdir())
    for name in names:
        mine = (directory / "fastload" / name).read_bytes()
        assert mine == (directory / "transformers" / name).read_bytes(), name


def operation_order(
    checkpoint: Path, operation: Any, monkeypatch: Any
) -> list[tuple[tuple[str, ...], str]]:
    """Loads ``checkpoint`` with fastload, recording each read (the names it fills) and each
    ``operation.convert`` (transformers' load operation: the layer it makes). Asserts that the
    reads and conversions alternate, one read before each conversion, and that the reads come
    in the order of the file; returns ``(names read, layer made)`` of each operation."""
    import fastload
    from fastload.core.reads import reading

    events: list[tuple[str, ...]] = []
    real_fill, real_convert = reading.fill, operation.convert

    def fill(file, items, *args, **kwargs):  # type: ignore[no-untyped-def]
        items = list(items)
        events.append(("read", *(name for name, _, _ in items)))
        return real_fill(file, items, *args, **kwargs)

    def convert(self, input_dict, **kwargs):  # type: ignore[no-untyped-def]
        events.append(("convert", kwargs["full_layer_name"]))
        return real_convert(self, input_dict, **kwargs)

    monkeypatch.setattr(reading, "fill", fill)
    monkeypatch.setattr(operation, "convert", convert)
    fastload.from_pretrained(checkpoint)
    data = (checkpoint / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    offsets = {n: v["data_offsets"][0] for n, v in header.items() if n != "__metadata__"}
    reads = [e[1:] for e in events if e[0] == "read"]
    converts = [e[1] for e in events if e[0] == "convert"]
    # each operation's inputs read, then converted, before the next is read
    assert [kind for kind, *_ in events] == ["read", "convert"] * len(converts)
    firsts = [min(offsets[n] for n in names) for names in reads]
    assert firsts == sorted(firsts)
    return list(zip(reads, converts, strict=True))


def rewritten(source: Path, tmp_path: Path, change: Any) -> Path:
    """A copy of checkpoint directory ``source`` under ``tmp_path`` whose ``model.safetensors``
    holds the tensors ``change`` (called with the name -> tensor dict) left or made."""
    import safetensors.torch as st

    directory = tmp_path / "changed"
    directory.mkdir()
    for f in source.iterdir():
        if f.name != "model.safetensors":
            (directory / f.name).write_bytes(f.read_bytes())
    tensors = st.load_file(str(source / "model.safetensors"))
    change(tensors)
    st.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def conversions(operation: Any, monkeypatch: Any) -> list[str]:
    """The layers transformers' load ``operation`` is run for from now on, recorded as it runs
    (none, where a plan refuses before any)."""
    ran: list[str] = []
    real = operation.convert

    def convert(self, input_dict, **kwargs):  # type: ignore[no-untyped-def]
        ran.append(kwargs["full_layer_name"])
        return real(self, input_dict, **kwargs)

    monkeypatch.setattr(operation, "convert", convert)
    return ran


def patched_and_transformers(
    directory: Path, method: str, transformers_loads: list[str], **kwargs: Any
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' ``from_pretrained`` of ``directory`` under fastload's patch, the same
    unpatched); asserts the patched load was fastload's: transformers' loader not run, no
    fallback, the report naming ``method``. ``transformers_loads``: the fixture counting
    transformers' own loads."""
    from transformers import AutoModelForCausalLM

    import fastload
    from fastload.hf import patch

    want = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    transformers_loads.clear()
    with fastload.patch_transformers():
        got = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    assert transformers_loads == []
    assert patch.last_fallback is None
    assert patch.last_report is not None and patch.last_report.quant_method == method
    return got, want
