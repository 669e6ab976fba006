"""How the checkpoints of ``benches/quantized_bench.py`` are made.

:func:`save_compressed`: the bf16 Llama, or the model quantized by compressed-tensors' own code
(every Linear layer but the head, weight-only, symmetric, its scales calibrated from the
weights) and saved as llm-compressor saves one.

:func:`make`: the formats that load through a quantizer's load operation (docs/quantized.md,
"Formats with a load operation"), each made of the bench's bf16 Llama (or its int4
checkpoint), as the tests make theirs (``tests/support/quantized_checkpoints.py``):

* ``fp8-blocks``: the Linear layers but the head in FP8 e4m3 per 128x128 block with float32
  inverse scales (``quant_method: fp8``), as transformers' FP8 quantizer stores them (it needs a
  GPU to quantize); transformers dequantizes them on a CPU (``Fp8Dequantize``);
* ``int4-dequantized``: the ``int4`` checkpoint (compressed-tensors ``pack-quantized``) whose
  config asks to dequantize it (``CompressedTensorsDequantize``); its safetensors file is a hard
  link to the ``int4`` one;
* ``bnb-nf4``, ``bnb-int8``: the model quantized on load by transformers' bitsandbytes quantizer
  on the CPU (4-bit nf4, 8-bit) and saved by its ``save_pretrained`` (``Bnb4bitDeserialize``,
  ``Bnb8bitDeserialize``);
* ``torchao-int8``, ``torchao-float8``: the same by transformers' torchao quantizer
  (``Int8WeightOnlyConfig``, ``Float8WeightOnlyConfig``; ``TorchAoDeserialize`` on load).

And two formats stored as they run, made as the tests make theirs (``tests/support/vllm_models.py``:
4 bits, groups of 128, random packed words: a load's time does not depend on the values):
``gptq`` and ``awq``, loaded by transformers through gptqmodel's CPU modules.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

#: format -> (what it is made of: "bf16" or "int4", the package it needs)
MADE: dict[str, tuple[str, str]] = {
    "fp8-blocks": ("bf16", "accelerate"),
    "int4-dequantized": ("int4", "compressed_tensors"),
    "bnb-nf4": ("bf16", "bitsandbytes"),
    "bnb-int8": ("bf16", "bitsandbytes"),
    "torchao-int8": ("bf16", "torchao"),
    "torchao-float8": ("bf16", "torchao"),
    "gptq": ("bf16", "gptqmodel"),
    "awq": ("bf16", "gptqmodel"),
}


def save_compressed(
    model: Any, directory: Path, spec: tuple[str | tuple[str, int], str] | None
) -> None:
    """Quantizes ``model`` by ``spec`` with compressed-tensors' own code (none: bf16) and saves it
    in one file, into a temporary folder renamed when complete."""
    import shutil

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    compressor = None
    if spec is not None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import (
            QuantizationArgs,
            QuantizationConfig,
            QuantizationScheme,
            apply_quantization_config,
            preset_name_to_scheme,
        )

        scheme, form = spec
        if isinstance(scheme, str):
            weights = preset_name_to_scheme(scheme, ["Linear"])
        else:
            kind, bits = scheme
            args = QuantizationArgs(num_bits=bits, type=kind, symmetric=True, strategy="channel")
            weights = QuantizationScheme(targets=["Linear"], weights=args)
        apply_quantization_config(
            model, QuantizationConfig(config_groups={"group_0": weights}, ignore=["lm_head"])
        )
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                _calibrate(module, weights.weights)
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form)
        compressor.compress_model(model)
    model.save_pretrained(tmp, max_shard_size="100GB")
    if compressor is not None:
        compressor.update_config(tmp)
    os.replace(tmp, directory)


def _calibrate(module: Any, args: Any) -> None:
    """The scales (and zero points, global scale) of the weights' ranges, per output channel or
    per group, as a calibration computes them."""
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


def _fp8_blocks(weight: Any) -> tuple[Any, Any]:
    import torch

    rows, cols = weight.shape
    grid = (math.ceil(rows / 128), math.ceil(cols / 128))
    pad = weight.float().new_zeros(grid[0] * 128, grid[1] * 128)
    pad[:rows, :cols] = weight.float()
    blocks = pad.reshape(grid[0], 128, grid[1], 128)
    inverse = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    values = (blocks / inverse[:, None, :, None]).clamp(-448, 448).reshape(pad.shape)
    return values[:rows, :cols].contiguous().to(torch.float8_e4m3fn), inverse


def _copy_side_files(source: Path, tmp: Path) -> None:
    for f in source.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp / f.name)


def make(name: str, source: Path, directory: Path) -> None:
    """The checkpoint of format ``name`` made of ``source`` (the bf16 or int4 checkpoint), in a
    temporary folder renamed ``directory`` when complete."""
    import torch

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if name == "fp8-blocks":
        import safetensors.torch as st

        _copy_side_files(source, tmp)
        tensors: dict[str, Any] = {}
        for path in sorted(source.glob("*.safetensors")):
            for key, tensor in st.load_file(str(path)).items():
                if key.endswith("proj.weight"):
                    tensors[key], tensors[key + "_scale_inv"] = _fp8_blocks(tensor)
                else:
                    tensors[key] = tensor
        st.save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "modules_to_not_convert": None,
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    elif name == "int4-dequantized":
        _copy_side_files(source, tmp)
        for path in source.glob("*.safetensors"):
            os.link(path, tmp / path.name)
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"]["dequantize"] = True
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    elif name in ("bnb-nf4", "bnb-int8"):
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        if name == "bnb-nf4":
            settings = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
        else:
            settings = BitsAndBytesConfig(load_in_8bit=True)
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=settings)
        shutil.rmtree(tmp)
        model.save_pretrained(tmp, max_shard_size="100GB")
    elif name in ("torchao-int8", "torchao-float8"):
        import torchao.quantization as tq
        from transformers import AutoModelForCausalLM, TorchAoConfig

        kind = tq.Int8WeightOnlyConfig if name == "torchao-int8" else tq.Float8WeightOnlyConfig
        settings = TorchAoConfig(kind())
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=settings)
        shutil.rmtree(tmp)
        model.save_pretrained(tmp, max_shard_size="100GB")
    elif name in ("gptq", "awq"):
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
        from vllm_models import quantize

        quantize(source, tmp, name)
    else:
        raise SystemExit(f"unknown format {name!r}")
    os.replace(tmp, directory)


def import_before_the_clock(directory: Path) -> None:
    """transformers' quantizers and operations these formats load through, and their packages,
    imported before a run's clock (where installed); gptqmodel (about 7 s to import, and it
    patches transformers' GPTQ quantizer) only for a GPTQ or AWQ checkpoint (``directory``)."""
    import importlib

    modules = [
        "accelerate",
        "bitsandbytes",
        "transformers.integrations.bitsandbytes",
        "transformers.integrations.finegrained_fp8",
        "transformers.integrations.compressed_tensors",
        "transformers.quantizers.quantizer_bnb_4bit",
        "transformers.quantizers.quantizer_bnb_8bit",
        "transformers.quantizers.quantizer_finegrained_fp8",
        "fastload.hf.load_ops",
    ]
    config = json.loads((directory / "config.json").read_text())
    method = config.get("quantization_config", {}).get("quant_method")
    if method == "torchao":
        modules += [
            "torchao",
            "torchao.sparsity",
            "torchao.prototype.awq",
            "torchao.prototype.parq",
            "torchao.prototype.smoothquant",
            "transformers.integrations.torchao",
            "transformers.quantizers.quantizer_torchao",
            "fastload.hf.load_op_checks_torchao",
        ]
    if method in ("gptq", "awq"):
        modules += ["gptqmodel", "optimum", f"transformers.quantizers.quantizer_{method}"]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
